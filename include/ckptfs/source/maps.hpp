// source/maps: the model map and config.json a user names (-o map=, -o hf_config=), read from
// their files into BuildOptions, and a checkpoint directory's own config.json.
#pragma once

#include <string>
#include <string_view>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::source {

// `map`: "none" (no map), a built-in's name, or a path (a value with a '/' or ending in
// ".json"); empty leaves detection on. `hf_config`: a config.json path; empty for none. Both
// files are read now (a regular file, at most 1 MiB, parsed strictly), so a bad value is refused
// before anything is mounted.
Status set_map_options(layout::BuildOptions& opts, std::string_view map,
                       std::string_view hf_config);

// The directory's own config.json, for a model map: its text when `dirfd` holds a regular
// config.json (symlinks not followed) of at most 1 MiB, else empty.
std::string read_dir_config(int dirfd);

}  // namespace ckptfs::source

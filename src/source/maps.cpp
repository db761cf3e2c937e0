// source/maps: reading the model map and config.json a user names, and a directory's config.json.
#include "ckptfs/source/maps.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/util/fd.hpp"

namespace ckptfs::source {

Status set_map_options(layout::BuildOptions& opts, std::string_view map,
                       std::string_view hf_config) {
  opts.map.reset();
  opts.no_map = false;
  if (map == "none") {
    opts.no_map = true;
  } else if (!map.empty()) {
    const bool path = map.find('/') != std::string_view::npos || map.ends_with(".json");
    if (!path) {
      opts.map = format::find_builtin_map(map);
      if (!opts.map) {
        std::string names;
        for (const auto& m : format::builtin_maps()) names += (names.empty() ? "" : ", ") + m->name;
        return make_error(EINVAL,
                          "map: no built-in map '{}' (built-in: {}; or a path to a .json map)", map,
                          names);
      }
    } else {
      CKPTFS_TRY(std::string text, read_small_file(std::string(map), format::kMaxMapBytes));
      CKPTFS_TRY(auto m, format::parse_model_map(text, map));
      opts.map = std::make_shared<const format::ModelMap>(std::move(m));
    }
  }
  opts.hf_config.clear();
  opts.hf_config_what.clear();
  if (!hf_config.empty()) {
    CKPTFS_TRY(std::string text, read_small_file(std::string(hf_config), format::kMaxConfigBytes));
    CKPTFS_CHECK(format::parse_map_config(text, hf_config));  // refused now, not per checkpoint
    opts.hf_config = std::move(text);
    opts.hf_config_what = std::string(hf_config);
  }
  return {};
}

std::string read_dir_config(int dirfd) {
  struct stat st {};
  auto fd = open_regular_at(dirfd, "config.json", "config.json", &st);
  if (!fd) return {};
  auto text = read_whole(*fd, st, "config.json", format::kMaxConfigBytes);
  return text ? std::move(text).value() : std::string();
}

}  // namespace ckptfs::source

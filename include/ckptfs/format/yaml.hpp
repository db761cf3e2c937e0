// format/yaml: untrusted YAML configs read into JSON, in the subset PyYAML writes (block style).
//
// Trainers keep their model config beside the weights in YAML: Megatron-Bridge's
// `iter_N/run_config.yaml` (ConfigContainer.to_yaml, yaml.safe_dump). This reader takes one
// document of what safe_dump writes in any of its styles, and what a person editing it would
// add: block mappings and sequences (an indentless sequence under a key too), scalar keys in
// either form (`? KEY` / `: VALUE`, as safe_dump writes an empty key), plain, single- and
// double-quoted scalars (folded over lines), literal and folded block scalars, flow collections,
// comments, anchors and aliases, and the core scalar tags (`!!int "5"`: safe_dump writes them
// where a style would change a value's type). Plain scalars resolve as PyYAML's SafeLoader
// resolves them (YAML 1.1: `yes`/`no` are bools, `1.0e-06` a float, `1e-06` a string).
// tests/python/test_yaml_pyyaml.py holds it to safe_load on random documents. Everything else
// is refused with the line: other tags (`!!python/...` constructs objects in PyYAML's unsafe
// loaders), merge keys (`<<`), collections as keys, duplicate keys, tabs in indentation, YAML
// 1.1's line breaks other than LF (NEL, LS, PS, raw), more than one document.
// Caps: bytes, lines, nodes (an alias counts the nodes it repeats), a scalar's bytes, and nesting
// at the JSON depth cap (kMaxJsonDepth), so what comes out is a value every JSON walker takes. Keys
// become JSON strings as written; a non-finite float becomes null (JSON has none).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

struct YamlLimits {
  uint64_t max_bytes = 4ull << 20;      // a run_config.yaml is ~20 KB
  size_t max_nodes = size_t{1} << 18;   // scalars and collections, aliases expanded
  size_t max_scalar_bytes = 64u << 10;  // one scalar's text
  size_t max_lines = size_t{1} << 18;   // ~600 in a run_config.yaml
};

// The document's value (null for an empty one). Errors (EINVAL, EFBIG) name `what` and the line.
Result<nlohmann::json> parse_yaml(std::string_view text, std::string_view what,
                                  const YamlLimits& limits = {});

}  // namespace ckptfs::format

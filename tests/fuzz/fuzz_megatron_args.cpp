// libFuzzer target: the model configs checkpoints carry, untrusted inputs, and what the built-in
// maps' hf_config templates make of whatever they yield: Megatron-LM's common.pt
// (format/megatron_args) and Megatron-Bridge's run_config.yaml (format/yaml,
// format/transformer_config).
//
// The input is read as a whole common.pt (a torch.save zip archive), as its data.pkl alone, and
// as a run_config.yaml (seeds: tests/fuzz/seeds-args and tests/fuzz/seeds-yaml). Whatever native
// config comes out is a JSON object of scalars; every built-in map's template is rendered over it
// (layout::render_hf_config): it must either refuse or give a JSON object, never crash, and a
// config it gives must be one build_checkpoint accepts as config.json text. The YAML reader's
// document must also survive a dump (valid UTF-8, within the JSON depth cap).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ckptfs/format/json_depth.hpp"
#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/model_map.hpp"
#include "ckptfs/format/transformer_config.hpp"
#include "ckptfs/format/yaml.hpp"
#include "ckptfs/layout/map_config.hpp"
#include "ckptfs/layout/model_map.hpp"

using namespace ckptfs;

namespace {

void render_all(const nlohmann::json& args) {
  if (!args.is_object()) __builtin_trap();
  for (const auto& m : format::builtin_maps()) {
    auto c = layout::render_hf_config(*m, args, "fuzz common.pt");
    if (!c) continue;
    if (!c->is_object()) __builtin_trap();
    auto again = format::parse_map_config(c->dump(2), "made config.json");
    if (!again) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto a = format::read_megatron_args(text, "fuzz common.pt")) render_all(*a);
  if (auto a = format::parse_megatron_args_pickle(std::string(text), "fuzz data.pkl")) {
    render_all(*a);
  }
  if (auto doc = format::parse_yaml(text, "fuzz.yaml")) {
    const std::string dumped = doc->dump();  // throws (a crash here) on a string not UTF-8
    if (format::json_too_deep_at(dumped) != std::string::npos) __builtin_trap();
  }
  if (auto a = format::read_bridge_run_config(text, "fuzz run_config.yaml")) render_all(*a);
  return 0;
}

// libFuzzer target: Megatron-LM's common.pt (format/megatron_args), an untrusted input, and what
// the built-in maps' hf_config templates make of whatever it yields.
//
// The input is read both as a whole common.pt (a torch.save zip archive) and as its data.pkl
// alone. Whatever args come out are a JSON object of scalars; every built-in map's template is
// rendered over them (layout::render_hf_config): it must either refuse or give a JSON object,
// never crash, and a config it gives must be one build_checkpoint accepts as config.json text.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/model_map.hpp"
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
  return 0;
}

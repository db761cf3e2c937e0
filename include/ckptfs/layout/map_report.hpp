// layout/map_report: why no model map serves a checkpoint whose stored names are a trainer's own
// (never a silently wrong model): what each built-in map's detect clause found.
//
// A stored name that some built-in map reads (a `from` or `detect` pattern of one) is a
// trainer's native name (Megatron-Core's `decoder.layers.*`, torchtitan's `tok_embeddings.*`):
// no HF class has such a parameter, so `from_pretrained` of the stored names would build a
// model of random weights and report only "missing keys". When no map applies to such a
// checkpoint, the view says why, per built-in map, and shows no config.json (fs/namespace.cpp,
// docs/semantics.md "Model maps").
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"

namespace ckptfs::layout {

struct MapReport {
  std::string native;               // a stored name a built-in map reads; empty: HF-like names
  std::vector<std::string> trials;  // "map: why it does not apply", one per built-in map
};

// `stored`: the checkpoint's tensors under their stored names; `format`: Checkpoint::format.
// Bounded: a name is matched only against patterns whose literal start it has.
MapReport explain_unmapped(const std::vector<Tensor>& stored, std::string_view format);

}  // namespace ckptfs::layout

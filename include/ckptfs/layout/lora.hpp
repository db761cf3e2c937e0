// layout/lora: the LoRA split. A PEFT LoRA model's state dict (verl's checkpoints with
// lora_rank > 0) is served as two things: the base model under its HF names in the checkpoint
// directory, and the adapter as PEFT's save_pretrained writes it (adapter_model.safetensors under
// PEFT's saved names, and adapter_config.json) in a folder of its own. Naming rules, checks and
// the config's text: pure, no I/O; the builder (layout/checkpoint.cpp) runs `apply` as a pass.
//
// The rules, for a stored name `base_model.model.<rest>` (PEFT's PeftModelForCausalLM wraps the
// HF model as base_model.model; verl's rank files hold model.state_dict() of that wrapper):
//   <module>.lora_A.default.weight, <module>.lora_B.default.weight  -> the adapter, as
//       base_model.model.<module>.lora_A.weight (the adapter name removed, as PEFT saves it);
//   <module>.base_layer.<param>  -> the base model, as <module>.<param> (what PEFT's unload()
//       leaves: the LoRA layer replaced by the layer it wraps);
//   any other <rest>  -> the base model, as <rest> (norms, embeddings, the LM head).
// Refused, naming the tensor: a name outside base_model.model., any other LoRA parameter
// (lora_embedding_A/B, lora_magnitude_vector: DoRA, a LoRA bias), an adapter name other than
// verl's "default", PEFT's modules_to_save copies, base_layer anywhere but before the last
// component, an empty component, and two stored names that give one served name.
//
// Merged (BuildOptions::lora_merged, -o lora=merged): each base weight with a LoRA layer is
// served as PEFT's merge_and_unload() leaves it, W + scale * (B @ A) with scale = lora_alpha / r,
// computed on read by io/merge.hpp. It rounds as PEFT does on CPU: A and B widened to F32, the
// product summed in F32 (fused multiply-adds over k in order, as torch's MKL GEMM) and scaled in
// F32, rounded to lora_B's dtype, then added to W in F32 and rounded to W's dtype (round to
// nearest even). Only F16, BF16 and F32 factors and weights are
// merged (F64 and the rest are refused, naming the tensor). The factors go to a hidden output
// (format::kLoraFactorsFolder), served as stored; no adapter folder is shown.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::layout::lora {

inline constexpr std::string_view kPeftPrefix = "base_model.model.";
// The adapter name get_peft_model gives, and the only one served.
inline constexpr std::string_view kAdapterName = "default";

// Where one stored tensor goes.
struct Placed {
  bool adapter = false;
  std::string name;    // served: its HF name (base), or PEFT's saved name (adapter)
  std::string module;  // adapter: the LoRA layer's module path below the HF model
  bool b = false;      // adapter: lora_B (else lora_A)
};

// The naming rules above for one stored name; the error says why it cannot be served.
Result<Placed> place(std::string_view stored);

// adapter_config.json for `in` (lora_train_meta.json) and the LoRA layers' module paths, as
// PEFT's LoraConfig.to_dict() writes the fields that decide how the adapter loads and computes
// (r, lora_alpha, target_modules, task_type, peft_type, bias, use_rslora, use_dora, ...), with
// 2-space indentation and sorted keys as save_pretrained does; base_model_name_or_path null.
std::string adapter_config_json(const LoraInput& in, const std::vector<std::string>& modules);

// The pass over a built checkpoint's tensors (in their stored order): renames each, gives it its
// output number in `tensor_k` (parallel to ck.tensors: the base tensors packed into 1..m with
// OutputPacker, the adapter's all in m + 1), checks the adapter (every LoRA layer has lora_A
// [r, in] and lora_B [out, r] with lora_train_meta.json's r and, when base weights are stored,
// a base layer [out, in]; no base layer without its LoRA pair), and sets ck.adapter. Returns m
// (0: no base tensor stored). Problems, at most 32 and a count, go to ck.problems. Linear in the
// tensors (hash maps by name and module). `merged`: the base weights are merged as above and
// ck.lora_merged is set in place of ck.adapter (where base weights are stored; else the adapter
// is shown as unmerged, and ck.adapter's note says why); the factors' output is still m + 1.
uint32_t apply(const LoraInput& in, bool merged, Checkpoint& ck, std::vector<uint32_t>& tensor_k);

}  // namespace ckptfs::layout::lora

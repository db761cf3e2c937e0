// layout/lora: the LoRA split of a PEFT LoRA state dict into the base model (HF names) and the
// adapter (PEFT's saved names), its checks, and adapter_config.json.
#include "ckptfs/layout/lora.hpp"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ckptfs/format/names.hpp"

namespace ckptfs::layout::lora {
namespace {

constexpr size_t kMaxProblems = 32;  // as the sources keep: enough to act on, bounded

std::string dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// The components of `s` split at '.', as views into it.
std::vector<std::string_view> components(std::string_view s) {
  std::vector<std::string_view> out;
  size_t at = 0;
  while (true) {
    const size_t dot = s.find('.', at);
    out.push_back(s.substr(at, dot == std::string_view::npos ? std::string_view::npos : dot - at));
    if (dot == std::string_view::npos) return out;
    at = dot + 1;
  }
}

std::string joined(std::span<const std::string_view> parts) {
  return fmt::format("{}", fmt::join(parts, "."));
}

// What a LoRA layer of the state dict holds, gathered by module path.
struct Layer {
  int32_t a = -1, b = -1, base = -1;  // tensor indexes in ck.tensors
};

// -o lora=merged computes in F32 (layout/lora.hpp): F16, BF16 and F32 only, A and B alike.
bool merge_dtype(format::DType d) {
  return d == format::DType::F16 || d == format::DType::BF16 || d == format::DType::F32;
}

Status mergeable(const Tensor& W, const Tensor& A, const Tensor& B) {
  if (!merge_dtype(W.src_dtype) || !merge_dtype(A.src_dtype) || A.src_dtype != B.src_dtype) {
    return make_error(EINVAL,
                      "-o lora=merged: a base weight of {} with lora_A {} and lora_B {} is not "
                      "merged (F16, BF16 or F32, and lora_A's dtype equal to lora_B's)",
                      format::dtype_name(W.src_dtype), format::dtype_name(A.src_dtype),
                      format::dtype_name(B.src_dtype));
  }
  return {};
}

// A factor of a merged view is read as stored, whatever the dtype policy: the merge rounds in
// the trained dtypes, as PEFT's does.
void served_as_stored(Tensor& t) {
  t.dtype = t.src_dtype;
  t.nbytes = *format::byte_size(t.dtype, t.numel);  // checked when the tensor was built
}

}  // namespace

Result<Placed> place(std::string_view stored) {
  if (!stored.starts_with(kPeftPrefix)) {
    return make_error(EINVAL,
                      "not under '{}' (a PEFT model's state dict holds every tensor there, and "
                      "lora_train_meta.json says this is one)",
                      kPeftPrefix);
  }
  const std::string_view rest = stored.substr(kPeftPrefix.size());
  const auto c = components(rest);
  const size_t n = c.size();
  for (auto part : c) {
    if (part.empty()) return make_error(EINVAL, "an empty name component");
  }
  Placed p;
  for (size_t i = 0; i < n; ++i) {
    if (c[i] == "modules_to_save" || c[i] == "original_module") {
      return make_error(EINVAL,
                        "PEFT's modules_to_save copies are not served (only the LoRA layers' "
                        "lora_A and lora_B, and the base model)");
    }
    if (!c[i].starts_with("lora_")) continue;
    if (c[i] != "lora_A" && c[i] != "lora_B") {
      return make_error(
          EINVAL,
          "'{}' is a LoRA parameter not served (only lora_A and lora_B of LoRA linear "
          "layers are: no lora_embedding_A/B, no DoRA lora_magnitude_vector)",
          c[i]);
    }
    if (i == 0 || i + 3 != n) {
      return make_error(EINVAL, "'{}' is not at <module>.{}.{}.weight", c[i], c[i], kAdapterName);
    }
    if (c[i + 1] != kAdapterName) {
      return make_error(EINVAL, "adapter '{}': only the adapter '{}' (verl's) is served", c[i + 1],
                        kAdapterName);
    }
    if (c[i + 2] != "weight") {
      return make_error(EINVAL,
                        "'{}.{}' of a LoRA layer is not served (only its weight: no LoRA bias)",
                        c[i], c[i + 2]);
    }
    p.adapter = true;
    p.b = c[i] == "lora_B";
    p.module = joined(std::span(c).first(i));
    p.name = fmt::format("{}{}.{}.weight", kPeftPrefix, p.module, c[i]);
    CKPTFS_CHECK(format::check_tensor_name(p.name, "its adapter name"));
    return p;
  }
  std::string name;
  for (size_t i = 0; i < n; ++i) {
    if (c[i] != "base_layer") continue;
    if (i == 0 || i + 2 != n) {
      return make_error(EINVAL, "'base_layer' is not at <module>.base_layer.<parameter>");
    }
    name = fmt::format("{}.{}", joined(std::span(c).first(i)), c[n - 1]);
  }
  p.name = name.empty() ? std::string(rest) : std::move(name);
  CKPTFS_CHECK(format::check_tensor_name(p.name, "its HF name"));
  return p;
}

std::string adapter_config_json(const LoraInput& in, const std::vector<std::string>& modules) {
  nlohmann::json j = {
      {"alpha_pattern", nlohmann::json::object()},
      {"base_model_name_or_path", nullptr},
      {"bias", "none"},
      {"exclude_modules", nullptr},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", in.lora_alpha},
      {"lora_bias", false},
      {"lora_dropout", 0.0},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", in.r},
      {"rank_pattern", nlohmann::json::object()},
      {"revision", nullptr},
      {"target_modules", modules},
      {"task_type", in.task_type ? nlohmann::json(*in.task_type) : nlohmann::json(nullptr)},
      {"use_dora", false},
      {"use_rslora", false},
  };
  return j.dump(2);
}

uint32_t apply(const LoraInput& in, bool merged, Checkpoint& ck, std::vector<uint32_t>& tensor_k) {
  size_t more = 0;
  auto problem = [&](std::string file, std::string tensor, std::string msg) {
    if (ck.problems.size() >= kMaxProblems) {
      ++more;
      return;
    }
    ck.problems.push_back({std::move(file), std::move(tensor), std::move(msg)});
  };
  auto files_of = [&](const Tensor& t) {
    return t.chunks.empty() ? ck.dir : ck.shards[t.chunks.front().shard].name;
  };
  std::vector<Placed> placed(ck.tensors.size());
  std::unordered_map<std::string, uint32_t> served;  // served name -> tensor index
  std::unordered_map<std::string, Layer> layers;     // module path -> its LoRA tensors
  uint32_t base = 0, adapter = 0;
  for (uint32_t i = 0; i < ck.tensors.size(); ++i) {
    const Tensor& t = ck.tensors[i];
    auto p = place(t.name);
    if (!p) {
      problem(files_of(t), t.name, p.error().message);
      continue;
    }
    if (auto [it, fresh] = served.emplace(p->name, i); !fresh) {
      problem(files_of(t), t.name,
              fmt::format("served as '{}', as '{}' is", p->name, ck.tensors[it->second].name));
      continue;
    }
    if (p->adapter) {
      Layer& l = layers[p->module];
      (p->b ? l.b : l.a) = static_cast<int32_t>(i);
      ++adapter;
    } else {
      ++base;
      if (t.name.ends_with(".base_layer.weight")) {
        layers[p->name.substr(0, p->name.size() - std::string_view(".weight").size())].base =
            static_cast<int32_t>(i);
      }
    }
    placed[i] = std::move(p).value();
  }
  auto more_problems = [&](std::string_view what) {
    if (more > 0) ck.problems.push_back({"", "", fmt::format("and {} more {}", more, what)});
    more = 0;
  };
  if (!ck.problems.empty()) {
    more_problems("LoRA naming problem(s)");
    return 0;
  }
  if (adapter == 0) {
    problem(in.file, "",
            "no LoRA layer (lora_A/lora_B) in the rank files: the checkpoint is not served as a "
            "LoRA model");
    return 0;
  }
  // Every LoRA layer: lora_A [r, in], lora_B [out, r] with the r verl recorded and, when the base
  // weights are stored, the layer it wraps [out, in]. In module order, so messages are stable.
  std::map<std::string_view, const Layer*> ordered;
  for (const auto& [m, l] : layers) ordered.emplace(m, &l);
  std::vector<std::string> modules;
  modules.reserve(ordered.size());
  std::vector<const Layer*> merges;  // the layers whose base weight is served merged
  for (const auto& [m, lp] : ordered) {
    const Layer& l = *lp;
    const std::string module(m);
    if (l.a < 0 || l.b < 0) {
      const int32_t any = l.a >= 0 ? l.a : l.b >= 0 ? l.b : l.base;
      const Tensor& t = ck.tensors[static_cast<uint32_t>(any)];
      problem(files_of(t), t.name,
              l.a < 0 && l.b < 0
                  ? fmt::format("a base layer of '{}' with no LoRA pair", module)
                  : fmt::format("LoRA layer '{}' has {} without {}", module,
                                l.a < 0 ? "lora_B" : "lora_A", l.a < 0 ? "lora_A" : "lora_B"));
      continue;
    }
    const Tensor& A = ck.tensors[static_cast<uint32_t>(l.a)];
    const Tensor& B = ck.tensors[static_cast<uint32_t>(l.b)];
    if (A.shape.size() != 2 || B.shape.size() != 2 || A.shape[0] != in.r || B.shape[1] != in.r) {
      problem(files_of(A), A.name,
              fmt::format("{} says r={}; this layer holds lora_A {} and lora_B {} (lora_A [r, in] "
                          "and lora_B [out, r] expected)",
                          in.file, in.r, dims(A.shape), dims(B.shape)));
      continue;
    }
    if (base > 0) {
      const Tensor* W = l.base >= 0 ? &ck.tensors[static_cast<uint32_t>(l.base)] : nullptr;
      if (!W) {
        problem(files_of(A), A.name,
                fmt::format("LoRA layer '{}' has no {}.base_layer.weight, where the other base "
                            "weights are stored",
                            module, module));
        continue;
      }
      if (W->shape.size() != 2 || W->shape[0] != B.shape[0] || W->shape[1] != A.shape[1]) {
        problem(files_of(*W), W->name,
                fmt::format("a base layer {} with lora_A {} and lora_B {} (base [out, in] "
                            "expected)",
                            dims(W->shape), dims(A.shape), dims(B.shape)));
        continue;
      }
      if (merged) {
        if (auto st = mergeable(*W, A, B); !st) {
          problem(files_of(*W), W->name, st.error().message);
          continue;
        }
        merges.push_back(&l);
      }
    }
    modules.push_back(module);
  }
  more_problems("LoRA problem(s)");
  if (!ck.problems.empty()) return 0;

  OutputPacker packer;
  for (uint32_t i = 0; i < ck.tensors.size(); ++i) {
    if (!placed[i].adapter) tensor_k[i] = packer.place(ck.tensors[i].nbytes);
  }
  const uint32_t m = base > 0 ? packer.outputs() : 0;
  for (uint32_t i = 0; i < ck.tensors.size(); ++i) {
    if (placed[i].adapter) tensor_k[i] = m + 1;
    ck.tensors[i].name = std::move(placed[i].name);
  }
  if (merged && base > 0) {
    // scale as PEFT's LoraLayer.update_layer (use_rslora false): lora_alpha / r in double, then
    // F32, as a Python float scalar is when it multiplies an F32 tensor.
    const auto scale = static_cast<float>(static_cast<double>(in.lora_alpha) / in.r);
    for (const Layer* l : merges) {
      ck.tensors[static_cast<uint32_t>(l->base)].merge =
          Tensor::Merge{static_cast<uint32_t>(l->a), static_cast<uint32_t>(l->b), scale};
      for (int32_t f : {l->a, l->b}) served_as_stored(ck.tensors[static_cast<uint32_t>(f)]);
    }
    ck.lora_merged = fmt::format(
        "LoRA (r={}, lora_alpha={}) merged: {} base weights served as W + {}/{} * (B @ A), as "
        "PEFT's merge_and_unload() gives them; no adapter folder (-o lora=merged)",
        in.r, in.lora_alpha, merges.size(), in.lora_alpha, in.r);
    return m;
  }
  Adapter a;
  a.dir = std::string(format::kLoraAdapterDir);
  a.k = m + 1;
  a.config_json = adapter_config_json(in, modules);
  a.base_tensors = base;
  a.adapter_tensors = adapter;
  a.layers = static_cast<uint32_t>(modules.size());
  if (merged && base == 0) {  // asked for, not done: the daemon's log says so (ck.notes)
    ck.notes.push_back(
        fmt::format("{}: -o lora=merged: the rank files hold no base weight to merge into (verl's "
                    "save_lora_only); {}/ is shown, as without the option",
                    ck.dir, format::kLoraAdapterDir));
  }
  a.note = base > 0 || !merged ? "" : "-o lora=merged: no base weight to merge into; ";
  a.note += base > 0 ? fmt::format(
                           "LoRA (r={}, lora_alpha={}): the base model's {} tensors under HF "
                           "names in the directory, the adapter ({} tensors, {} layers) in {}/",
                           in.r, in.lora_alpha, base, adapter, a.layers, a.dir)
                     : fmt::format(
                           "LoRA (r={}, lora_alpha={}): the rank files hold the adapter only "
                           "({} tensors, {} layers; verl's save_lora_only): {}/ is shown, and no "
                           "base model files (load the base model from where training began)",
                           in.r, in.lora_alpha, adapter, a.layers, a.dir);
  ck.adapter = std::move(a);
  return m;
}

}  // namespace ckptfs::layout::lora

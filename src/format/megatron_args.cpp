// format/megatron_args: Megatron-LM's `args` in common.pt, read as an inert record.
#include "ckptfs/format/megatron_args.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/pickle.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::format {
namespace {

using pickle::GlobalName;
using pickle::Kind;
using pickle::Ref;

// What a real common.pt holds (measured with Megatron-LM core_v0.16.1's parse_args and
// generate_state_dict): the Namespace, the dtypes of params_dtype and its kin, the enums its
// args keep (attention_backend, exit_signal), and tensor records (never read). Each is a name:
// nothing is called.
const std::vector<GlobalName>& args_globals() {
  static const std::vector<GlobalName> g = [] {
    std::vector<GlobalName> v = {
        {"argparse", "Namespace"},
        {"megatron.core.transformer.enums", "AttnBackend"},
        {"megatron.core.enums", "ModelType"},
        {"signal", "Signals"},
    };
    auto t = torch_tensor_globals();
    v.insert(v.end(), t.begin(), t.end());
    return v;
  }();
  return g;
}

bool is_dtype_global(const pickle::Pickle& p, const pickle::Value& v) {
  if (v.kind != Kind::Global || p.text(v) != "torch") return false;
  const std::string_view n = p.name(v);
  return n != "Size" && !n.ends_with("Storage");
}

}  // namespace

Result<nlohmann::json> parse_megatron_args_pickle(std::string&& bytes, std::string_view what) {
  pickle::Limits limits;
  limits.max_bytes = kMaxMegatronCommonPickleBytes;
  limits.max_values = size_t{1} << 20;
  limits.max_memo = size_t{1} << 20;
  limits.max_refs = size_t{1} << 22;
  CKPTFS_TRY(auto p, pickle::parse(std::move(bytes), args_globals(), what, limits));
  pickle::Walk w(p, what);
  CKPTFS_TRY(auto top, w.pairs(p.root(), "the saved object"));
  auto args = w.field(top, "args");
  if (!args) {
    return make_error(ENOENT,
                      "{}: no 'args' in the saved dict (Megatron-LM saves them; "
                      "megatron-core's dist_checkpointing.save alone does not)",
                      what);
  }
  CKPTFS_TRY(auto fields, w.object_state(*args, "argparse", "Namespace", "'args'"));
  nlohmann::json out = nlohmann::json::object();
  for (size_t k = 0; k + 1 < fields.size(); k += 2) {
    const pickle::Value& key = p.at(fields[k]);
    if (key.kind != Kind::Str) return w.fail("a field name of 'args'", "a str", fields[k]);
    CKPTFS_TRY(std::string_view name, w.text(fields[k], "a field name of 'args'"));
    if (name.empty() || name.size() > 256) {
      return make_error(EINVAL, "{}: 'args' has a field name of {} bytes (1 to 256)", what,
                        name.size());
    }
    const pickle::Value& v = p.at(fields[k + 1]);
    nlohmann::json val;
    switch (v.kind) {
      case Kind::None:
        val = nullptr;
        break;
      case Kind::Bool:
        val = v.i != 0;
        break;
      case Kind::Int:
        val = v.i;
        break;
      case Kind::Float: {
        const double d = v.as_double();
        if (!std::isfinite(d)) continue;  // no JSON for it
        val = d;
        break;
      }
      case Kind::Str: {
        auto s = w.text(fields[k + 1], fmt::format("args.{}", printable(name.substr(0, 64))));
        if (!s) return std::move(s).error();
        if (s->size() > kMaxNativeFieldChars) continue;  // a path or a list as text: not a size
        val = std::string(*s);
        break;
      }
      case Kind::Global:
        if (!is_dtype_global(p, v)) continue;
        val = std::string(p.name(v));
        break;
      case Kind::List:
      case Kind::Tuple: {
        // A list of integers or bools (moe_layer_freq's per-layer pattern); other lists (of
        // paths, of strings; empty ones, which say nothing) are nothing an HF config reads.
        if (v.items.empty() || v.items.size() > kMaxNativeListItems) continue;
        nlohmann::json arr = nlohmann::json::array();
        bool plain = true;
        for (const Ref e : v.items) {
          const pickle::Value& x = p.at(e);
          if (x.kind == Kind::Bool) {
            arr.push_back(x.i != 0);
          } else if (x.kind == Kind::Int) {
            arr.push_back(x.i);
          } else {
            plain = false;
            break;
          }
        }
        if (!plain) continue;
        val = std::move(arr);
        break;
      }
      default:
        continue;  // enums, objects, other lists: nothing an HF config reads
    }
    if (!out.contains(std::string(name)) && out.size() >= kMaxNativeConfigFields) {
      return make_error(EINVAL, "{}: 'args' has more than {} fields", what, kMaxNativeConfigFields);
    }
    out[std::string(name)] = std::move(val);  // set twice: the last wins, as in Python
  }
  return out;
}

Result<nlohmann::json> read_megatron_args(std::string_view archive, std::string_view what) {
  if (archive.size() > kMaxMegatronCommonBytes) {
    return make_error(EFBIG, "{}: {} bytes (at most {})", what, archive.size(),
                      kMaxMegatronCommonBytes);
  }
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > archive.size() || out.size() > archive.size() - off) {
      return make_error(EINVAL, "{}: a read past the end of the archive", what);
    }
    std::memcpy(out.data(), archive.data() + off, out.size());
    return {};
  };
  const zip::Limits limits{4096, 1 << 20};  // a common.pt: a pickle and a few tensors
  CKPTFS_TRY(auto members, zip::members(archive.size(), read, what, limits));
  CKPTFS_TRY(auto ar, zip::torch_archive(std::move(members), what));
  if (ar.pickle.size > kMaxMegatronCommonPickleBytes) {
    return make_error(EFBIG, "{}: data.pkl of {} bytes (at most {})", what, ar.pickle.size,
                      kMaxMegatronCommonPickleBytes);
  }
  std::string pkl(archive.substr(ar.pickle.offset, ar.pickle.size));
  return parse_megatron_args_pickle(std::move(pkl), what);
}

}  // namespace ckptfs::format

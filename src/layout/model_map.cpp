// layout/model_map: compiling a model map against stored tensors and config.json into runs (one
// cohesive thing: the Compiler, whose passes over a rule share its state: bindings, part plans,
// runs, the no-byte-twice check). Choosing and applying a map is layout/map_apply; sizes by
// name are layout/map_sizes.
#include "ckptfs/layout/model_map.hpp"

#include "ckptfs/layout/map_config.hpp"
#include "map_sizes.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <span>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/checked.hpp"

namespace ckptfs::layout {
namespace {

using format::MapExpr;
using format::MapPart;
using format::MapRule;

constexpr uint64_t kMaxRowsPerPart = uint64_t{1} << 24;

std::string dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// A row sequence compressed into runs as it is produced.
class RunBuilder {
 public:
  RunBuilder(std::vector<MapRun>& out, uint32_t src, uint64_t row_elems, uint64_t out_elem)
      : out_(out), src_(src), row_(row_elems), out_elem_(out_elem) {}

  void row(uint64_t src_elem) {
    if (have_ && cur_.src_elem + cur_.len == src_elem) {
      cur_.len += row_;
      return;
    }
    flush_block();
    cur_ = MapRun{src_, out_elem_, src_elem, row_, 1, 0};
    have_ = true;
  }
  void finish() { flush_block(); }

 private:
  // Appends the block in cur_ to out_, merging it into the last run when it continues its
  // stride with the same length.
  void flush_block() {
    if (!have_) return;
    have_ = false;
    out_elem_ += cur_.len;
    if (!out_.empty()) {
      auto& l = out_.back();
      if (l.src == cur_.src && l.len == cur_.len && l.reps == 1) {
        const uint64_t next = l.src_elem + l.count * l.stride;
        if (l.count == 1 && cur_.src_elem > l.src_elem) {
          l.stride = cur_.src_elem - l.src_elem;
          l.count = 2;
          return;
        }
        if (l.count > 1 && next == cur_.src_elem) {
          ++l.count;
          return;
        }
      }
    }
    out_.push_back(cur_);
  }

  std::vector<MapRun>& out_;
  uint32_t src_;
  uint64_t row_;
  uint64_t out_elem_;
  MapRun cur_{};
  bool have_ = false;
};

class Compiler {
 public:
  Compiler(const format::ModelMap& m, const nlohmann::json& config, std::string_view config_what,
           const std::vector<Tensor>& stored)
      : map_(m), config_(config), config_what_(config_what), stored_(stored), sizes_(m, config) {
    for (uint32_t i = 0; i < stored_.size(); ++i) {
      by_name_.emplace(std::string(map_stored_name(map_, stored_[i].name)), i);
    }
    used_.assign(stored_.size(), false);
    when_dropped_.assign(stored_.size(), false);
    where_ = map_.origin.empty() ? fmt::format("map '{}'", map_.name)
                                 : fmt::format("map '{}' ({})", map_.name, map_.origin);
  }

  CompiledMap run() {
    if (auto r = map_refuses(map_, stored_)) {
      problem(stored_[r->tensor].name,
              fmt::format("{} cannot serve this stored tensor: {}", where_, r->refusal->why));
      return std::move(out_);
    }
    std::set<std::string> names;
    for (const auto& r : map_.rules) {
      const size_t before = out_.tensors.size();
      rule(r, names);
      if (!out_.problems.empty()) return std::move(out_);
      made_[r.hf.text] += out_.tensors.size() - before;
      if (!r.optional || !when_holds(r)) made_[r.hf.text] += 1;  // not an alternative
    }
    // Optional rules naming the same HF tensor are alternatives (a norm fused into a linear or
    // separate): when none of them found a stored tensor, the tensor would be silently missing,
    // unless one of them says the tensor may be absent.
    for (const auto& r : map_.rules) {
      if (!r.optional || made_[r.hf.text] > 0) continue;
      if (std::any_of(map_.rules.begin(), map_.rules.end(),
                      [&](const auto& o) { return o.hf.text == r.hf.text && o.may_be_absent; })) {
        continue;
      }
      const auto alternatives =
          std::count_if(map_.rules.begin(), map_.rules.end(),
                        [&](const auto& o) { return o.hf.text == r.hf.text; });
      if (alternatives < 2) continue;
      problem(r.hf.text, fmt::format("{}: none of the {} rules making '{}' found a stored tensor",
                                     where_, alternatives, r.hf.text));
      made_[r.hf.text] = 1;  // said once
    }
    if (!out_.problems.empty()) return std::move(out_);
    for (uint32_t i = 0; i < stored_.size(); ++i) {
      if (used_[i]) continue;
      const auto n = map_stored_name(map_, stored_[i].name);
      const bool dropped =
          when_dropped_[i] || std::any_of(map_.drop.begin(), map_.drop.end(), [&](const auto& p) {
            return format::match_pattern(p, n).has_value();
          });
      if (dropped) {
        ++out_.dropped;
        continue;
      }
      problem(stored_[i].name,
              fmt::format("stored tensor is neither mapped nor dropped by {}", where_));
    }
    if (!out_.problems.empty()) out_.tensors.clear();
    return std::move(out_);
  }

 private:
  void problem(std::string tensor, std::string msg) {
    if (out_.problems.size() >= 20) return;  // enough to act on
    out_.problems.push_back(Problem{std::string(config_what_), std::move(tensor), std::move(msg)});
  }

  std::string rule_where(const MapRule& r) const {
    return fmt::format("{} rule {} ('{}')", where_, r.number, r.hf.text);
  }

  // Every binding of the rule's captures, or an empty list with a problem.
  std::vector<Binding> bindings(const MapRule& r, bool& none) {
    std::vector<Binding> out;
    const auto& from = r.parts[0].from;
    const auto caps = from.captures();
    none = false;
    if (caps.empty()) {
      out.emplace_back();
    } else {
      std::set<std::vector<uint64_t>> seen;
      for (const auto& [n, i] : by_name_) {
        if (auto v = format::match_pattern(from, n)) seen.insert(*v);
      }
      for (const auto& v : seen) {
        Binding b;
        for (size_t i = 0; i < caps.size(); ++i) b.emplace_back(caps[i], v[i]);
        out.push_back(std::move(b));
      }
      if (out.empty()) none = true;
    }
    auto over = [&](uint64_t n) {
      total_bindings_ += n;
      if (total_bindings_ <= kMaxBindingsTotal) return false;
      problem(r.hf.text, fmt::format("{}: the map binds more than {} names in all", rule_where(r),
                                     kMaxBindingsTotal));
      return true;
    };
    if (over(out.size())) return {};
    for (const auto& [cap, expr] : r.for_) {
      sizes_.scope(&r.let, nullptr, nullptr);
      auto n = sizes_.eval(expr);
      if (!n) {
        problem(r.hf.text, fmt::format("{}: 'for' {}: {}", rule_where(r), cap, n.error().message));
        return {};
      }
      if (*n > kMaxForCount) {
        problem(r.hf.text, fmt::format("{}: 'for' {} counts {} (at most {})", rule_where(r), cap,
                                       *n, kMaxForCount));
        return {};
      }
      for_counts_.emplace_back(cap, *n);
      std::vector<Binding> next;
      for (const auto& b : out) {
        for (uint64_t i = 0; i < *n; ++i) {
          auto c = b;
          c.emplace_back(cap, i);
          next.push_back(std::move(c));
          if (over(1)) return {};
          if (next.size() > kMaxMappedTensors) {
            problem(r.hf.text,
                    fmt::format("{}: more than {} bindings", rule_where(r), kMaxMappedTensors));
            return {};
          }
        }
      }
      out = std::move(next);
    }
    return out;
  }

  bool when_holds(const MapRule& r) const {
    if (r.when.empty()) return true;
    const bool v = config_value(config_, r.when).value_or(0) != 0;
    return v != r.when_not;
  }

  // A stored tensor named by `from` under binding `b`, or UINT32_MAX.
  uint32_t find(const MapPart& p, const Binding& b) const {
    auto it = by_name_.find(format::expand_pattern(p.from, b));
    return it == by_name_.end() ? UINT32_MAX : it->second;
  }

  void rule(const MapRule& r, std::set<std::string>& names) {
    bool none = false;
    for_counts_.clear();
    auto binds = bindings(r, none);
    if (!out_.problems.empty()) return;
    if (!when_holds(r)) {  // its stored tensors count as dropped
      for (const auto& b : binds) {
        for (const auto& p : r.parts) {
          if (auto s = find(p, b); s != UINT32_MAX) when_dropped_[s] = true;
        }
      }
      return;
    }
    if (none) {
      if (!r.optional) {
        problem(r.hf.text, fmt::format("{}: no stored tensor matches '{}'", rule_where(r),
                                       r.parts[0].from.text));
      }
      return;
    }
    for (const auto& b : binds) {
      std::vector<uint32_t> src;
      for (const auto& p : r.parts) src.push_back(find(p, b));
      if (std::find(src.begin(), src.end(), UINT32_MAX) != src.end()) {
        if (r.optional) continue;
        for (size_t i = 0; i < src.size(); ++i) {
          if (src[i] == UINT32_MAX) {
            problem(format::expand_pattern(r.parts[i].from, b),
                    fmt::format("{}: no such stored tensor", rule_where(r)));
          }
        }
        return;
      }
      MappedTensor t;
      Binding hb = b;  // the HF name's captures: `offset` added
      if (!r.offset.empty()) {
        sizes_.scope(&r.let, nullptr, &b);
        for (const auto& [cap, e] : r.offset) {
          auto v = sizes_.eval(e);
          if (!v) {
            problem(r.hf.text,
                    fmt::format("{}: 'offset' {}: {}", rule_where(r), cap, v.error().message));
            return;
          }
          for (auto& [k, x] : hb) {
            if (k != cap) continue;
            auto sum = checked_add(x, *v);
            if (!sum) {
              problem(r.hf.text, fmt::format("{}: 'offset' {} overflows", rule_where(r), cap));
              return;
            }
            x = *sum;
          }
        }
      }
      t.name = format::expand_pattern(r.hf, hb);
      if (auto named = format::check_tensor_name(t.name, rule_where(r)); !named) {
        problem(t.name, named.error().message);
        return;
      }
      if (!names.insert(t.name).second) {
        problem(t.name, fmt::format("{}: the HF name is made twice", rule_where(r)));
        return;
      }
      if (out_.tensors.size() >= kMaxMappedTensors) {
        problem(t.name, fmt::format("{} makes more than {} tensors", where_, kMaxMappedTensors));
        return;
      }
      if (!make(r, b, src, t)) return;
      for (uint32_t s : src) used_[s] = true;
      total_runs_ += t.runs.size();  // make() kept it within kMaxRunsTotal
      out_.tensors.push_back(std::move(t));
    }
  }

  // One part of a rule, planned: the rows of one stored tensor it reads, in output order. Its
  // rows are distinct by construction: `index` selects one prefix, each `rows` LHS name splits
  // its axis row-major and appears exactly once after `->` (format/map_lang), and slices lie
  // inside their axis (checked here). So one part never reads a stored element twice; only two
  // parts of one HF tensor that read the same stored tensor can (no_byte_twice).
  struct PartPlan {
    struct Ax {
      uint64_t lo, n, stride;  // a slice of a named axis; stride in rows of the stored tensor
    };
    uint32_t src = 0;
    uint64_t base = 0;     // the stored element the selection starts at
    uint64_t inner = 0;    // elements per row: the last axis (the whole selection without `rows`)
    std::vector<Ax> axes;  // the output's named axes in order; empty: one row
    uint64_t rows = 0;
    std::vector<uint64_t> shape;  // the part's output shape
    uint64_t lo = 0, hi = 0;      // the stored elements it reads lie in [lo, hi) (its hull)
    [[nodiscard]] uint64_t elems() const { return rows * inner; }
  };

  // Plans one part: its selection, its axes and their slices, checked against the stored tensor.
  bool plan_part(const MapRule& r, const MapPart& p, const Binding& b, uint32_t si,
                 PartPlan& plan) {
    const Tensor& s = stored_[si];
    sizes_.scope(&r.let, &p.let, &b);
    auto fail = [&](std::string axis, std::string msg) {
      problem(s.name, fmt::format("{}: {}{}", rule_where(r), axis.empty() ? "" : axis + ": ", msg));
      return false;
    };
    plan = PartPlan{};
    plan.src = si;
    if (p.index.size() > s.shape.size()) {
      return fail("", fmt::format("'index' selects {} axes of a tensor of shape {}", p.index.size(),
                                  dims(s.shape)));
    }
    uint64_t base = 0;
    for (size_t d = 0; d < p.index.size(); ++d) {
      const auto& ix = p.index[d];
      std::optional<uint64_t> v;
      if (!ix.capture.empty()) {
        for (const auto& [k, x] : b) {
          if (k == ix.capture) v = x;
        }
      }
      if (!v) {
        auto e = sizes_.eval(*ix.value);
        if (!e) return fail(fmt::format("axis {}", d), e.error().message);
        v = *e;
      }
      for (const auto& [cap, count] : for_counts_) {
        if (cap == ix.capture && count != s.shape[d]) {
          return fail(fmt::format("axis {}", d),
                      fmt::format("'for' {} counts {} but the axis holds {} (shape {}, config {})",
                                  cap, count, s.shape[d], dims(s.shape), config_what_));
        }
      }
      if (*v >= s.shape[d]) {
        return fail(fmt::format("axis {}", d),
                    fmt::format("index {} ('{}') is beyond the axis's {} of shape {}", *v,
                                ix.value->text, s.shape[d], dims(s.shape)));
      }
      base += *v * s.strides[d];  // < numel: no overflow
    }
    plan.base = base;
    std::vector<uint64_t> rest(s.shape.begin() + static_cast<ptrdiff_t>(p.index.size()),
                               s.shape.end());
    if (rest.empty()) {
      if (p.rows) return fail("", "'rows' on a tensor with no axes left");
      plan.inner = 1;
      plan.rows = 1;
      plan.lo = base;
      plan.hi = base + 1;
      return true;
    }
    // `rows` naming the only axis of a 1-D tensor moves single elements: a bias split like its
    // weight. Otherwise a row is the last axis, never rearranged (no transpose in runs of one).
    const bool every_axis = p.rows && rest.size() == 1 && p.rows->lhs.size() == 1;
    const uint64_t inner = every_axis ? 1 : rest.back();  // elements per row
    const std::vector<uint64_t> lead(rest.begin(), every_axis ? rest.end() : rest.end() - 1);
    if (!p.rows) {
      plan.shape = rest;
      uint64_t n = 1;
      for (auto d : rest) n *= d;  // <= numel
      plan.inner = n;
      plan.rows = 1;
      plan.lo = base;
      plan.hi = base + n;
      return true;
    }
    const auto& rows = *p.rows;
    if (rows.lhs.size() != lead.size()) {
      return fail("",
                  fmt::format("'rows' {} describes {} axes; the tensor of shape {} has {} "
                              "leading axes (a 1-D tensor's one axis may be named)",
                              rows.text, rows.lhs.size(), dims(rest), lead.size(), rest.size()));
    }
    // What makes the rows distinct, checked where it is relied on: each name once after '->'.
    std::vector<uint32_t> used(rows.names.size(), 0);
    for (const auto& g : rows.rhs) {
      for (const auto& o : g) ++used[o.axis];
    }
    if (std::any_of(used.begin(), used.end(), [](uint32_t n) { return n != 1; })) {
      return fail("", fmt::format("'rows' {} does not name each axis once after '->'", rows.text));
    }
    // Sizes of the named axes, one unknown per group inferred from the stored size.
    std::vector<uint64_t> size(rows.names.size(), 0);
    for (size_t g = 0; g < rows.lhs.size(); ++g) {
      uint64_t known = 1;
      int unknown = -1;
      std::vector<std::string> desc;
      for (uint32_t a : rows.lhs[g]) {
        sizes_.clear_error();
        auto v = sizes_.lookup(rows.names[a]);
        if (sizes_.error()) return fail(fmt::format("axis {}", g), sizes_.error()->message);
        if (!v) {
          if (unknown >= 0) {
            return fail(fmt::format("axis {}", g),
                        fmt::format("'{}' and '{}' are both unknown sizes", rows.names[unknown],
                                    rows.names[a]));
          }
          unknown = static_cast<int>(a);
          continue;
        }
        size[a] = *v;
        desc.push_back(fmt::format("{}={}", rows.names[a], *v));
        auto k = checked_mul(known, *v);
        if (!k) return fail(fmt::format("axis {}", g), "sizes overflow");
        known = *k;
      }
      const uint64_t dim = lead[g];
      if (unknown >= 0) {
        if (known == 0 || dim % known != 0) {
          return fail(fmt::format("axis {}", g),
                      fmt::format("{} rows do not divide by {} ({}; config {})", dim, known,
                                  fmt::join(desc, " x "), config_what_));
        }
        size[static_cast<size_t>(unknown)] = dim / known;
      } else if (known != dim) {
        return fail(fmt::format("axis {}", g),
                    fmt::format("{} rows, but {} gives {} (config {})", dim, fmt::join(desc, " x "),
                                known, config_what_));
      }
    }
    // Source stride of each named axis (row-major in LHS order), in rows.
    std::vector<uint64_t> stride(rows.names.size(), 0);
    {
      uint64_t st = 1;
      for (size_t g = rows.lhs.size(); g-- > 0;) {
        for (size_t i = rows.lhs[g].size(); i-- > 0;) {
          stride[rows.lhs[g][i]] = st;
          st *= size[rows.lhs[g][i]];  // product = a stored dim's rows: no overflow
        }
      }
    }
    // The output axes in order, with their slices.
    for (const auto& g : rows.rhs) {
      uint64_t gs = 1;
      for (const auto& o : g) {
        uint64_t lo = 0, hi = size[o.axis];
        if (o.lo) {
          auto l = sizes_.eval(*o.lo);
          auto h = sizes_.eval(*o.hi);
          if (!l) return fail(rows.names[o.axis], l.error().message);
          if (!h) return fail(rows.names[o.axis], h.error().message);
          if (*l > *h || *h > size[o.axis]) {
            return fail(rows.names[o.axis],
                        fmt::format("slice [{}:{}] is outside the axis's {} (config {})", *l, *h,
                                    size[o.axis], config_what_));
          }
          lo = *l;
          hi = *h;
        }
        plan.axes.push_back(PartPlan::Ax{lo, hi - lo, stride[o.axis]});
        gs *= hi - lo;
      }
      plan.shape.push_back(gs);
    }
    if (!every_axis) plan.shape.push_back(inner);
    uint64_t nrows = 1;
    for (const auto& a : plan.axes) nrows *= a.n;
    if (nrows > kMaxRowsPerPart) {
      return fail("", fmt::format("{} rows (at most {})", nrows, kMaxRowsPerPart));
    }
    total_rows_ += nrows;
    if (total_rows_ > kMaxRowsTotal) {
      return fail("", fmt::format("the map enumerates more than {} rows in all", kMaxRowsTotal));
    }
    plan.inner = inner;
    plan.rows = nrows;
    if (nrows > 0 && inner > 0) {  // the first and the last row read, by the slices' ends
      uint64_t first = 0, last = 0;
      for (const auto& a : plan.axes) {
        first += a.lo * a.stride;
        last += (a.lo + a.n - 1) * a.stride;
      }
      plan.lo = base + first * inner;
      plan.hi = base + (last + 1) * inner;
    }
    return true;
  }

  // Appends a planned part's rows to `out` as runs, compressed as they are produced; false as
  // soon as `out` holds more than `limit` runs (the rest is not produced). Time: one step per
  // row; memory: the runs.
  static bool emit(const PartPlan& p, uint64_t out_elem, std::vector<MapRun>& out, uint64_t limit) {
    if (p.rows == 0 || p.inner == 0) return true;
    RunBuilder rb(out, p.src, p.inner, out_elem);
    // Axes of one index add a constant: only the others are stepped through.
    std::vector<PartPlan::Ax> ax;
    uint64_t row = 0;
    for (const auto& a : p.axes) {
      row += a.lo * a.stride;
      if (a.n != 1) ax.push_back(a);
    }
    std::vector<uint64_t> idx(ax.size(), 0);
    for (uint64_t k = 0; k < p.rows; ++k) {
      rb.row(p.base + row * p.inner);
      if (out.size() > limit) return false;
      for (size_t i = ax.size(); i-- > 0;) {
        if (++idx[i] < ax[i].n) {
          row += ax[i].stride;
          break;
        }
        row -= (ax[i].n - 1) * ax[i].stride;
        idx[i] = 0;
      }
    }
    rb.finish();
    return out.size() <= limit;
  }

  bool make(const MapRule& r, const Binding& b, const std::vector<uint32_t>& src, MappedTensor& t) {
    const Tensor& first = stored_[src[0]];
    if (format::dtype_bits(first.dtype) % 8 != 0) {
      problem(first.name, fmt::format("{}: {} elements are smaller than a byte; maps move whole "
                                      "bytes",
                                      rule_where(r), format::dtype_name(first.dtype)));
      return false;
    }
    t.dtype = first.dtype;
    t.src_dtype = first.src_dtype;
    std::vector<PartPlan> plans(r.parts.size());
    std::vector<std::string> origins;
    for (size_t i = 0; i < r.parts.size(); ++i) {
      const Tensor& s = stored_[src[i]];
      if (s.dtype != t.dtype) {
        problem(s.name,
                fmt::format("{}: concatenates {} with {} ('{}')", rule_where(r),
                            format::dtype_name(s.dtype), format::dtype_name(t.dtype), first.name));
        return false;
      }
      if (!plan_part(r, r.parts[i], b, src[i], plans[i])) return false;
      const auto& shape = plans[i].shape;
      if (i == 0) {
        t.shape = shape;
      } else {
        if (shape.empty() || t.shape.empty() ||
            !std::equal(shape.begin() + 1, shape.end(), t.shape.begin() + 1, t.shape.end())) {
          problem(s.name, fmt::format("{}: part {} has shape {}, which does not join part 1's {} "
                                      "along axis 0",
                                      rule_where(r), i + 1, dims(shape), dims(t.shape)));
          return false;
        }
        t.shape[0] += shape[0];
      }
      origins.push_back(s.name);
    }
    t.origin = fmt::format("{} (rule {}: {})", fmt::join(origins, " ++ "), r.number, r.text);
    if (r.transpose) {  // format/model_map: one part, no `rows`, no `split_last`
      if (t.shape.size() < 2) {
        problem(first.name, fmt::format("{}: 'transpose' of a tensor of shape {}: it needs two "
                                        "axes after 'index'",
                                        rule_where(r), dims(t.shape)));
        return false;
      }
      std::swap(t.shape[t.shape.size() - 2], t.shape.back());
    }
    if (r.split_last) {
      // The last axis written as several, row-major: the bytes and their order are unchanged.
      sizes_.scope(&r.let, nullptr, &b);
      if (t.shape.empty()) {
        problem(t.name, fmt::format("{}: 'split_last' on a tensor with no axes", rule_where(r)));
        return false;
      }
      std::vector<uint64_t> split;
      std::vector<std::string> desc;
      uint64_t prod = 1;
      for (const auto& e : *r.split_last) {
        auto v = sizes_.eval(e);
        if (!v) {
          problem(t.name,
                  fmt::format("{}: 'split_last' {}: {}", rule_where(r), e.text, v.error().message));
          return false;
        }
        auto p = checked_mul(prod, *v);
        if (!p) {
          problem(t.name, fmt::format("{}: 'split_last' sizes overflow", rule_where(r)));
          return false;
        }
        prod = *p;
        split.push_back(*v);
        desc.push_back(fmt::format("{}={}", e.text, *v));
      }
      if (prod != t.shape.back()) {
        problem(first.name,
                fmt::format("{}: the last axis of '{}' is {}, but 'split_last' {} gives {} ({})",
                            rule_where(r), t.name, t.shape.back(), fmt::join(desc, " x "), prod,
                            config_what_));
        return false;
      }
      if (t.shape.size() - 1 + split.size() > 16) {
        problem(t.name, fmt::format("{}: 'split_last' makes more than 16 axes", rule_where(r)));
        return false;
      }
      t.shape.pop_back();
      t.shape.insert(t.shape.end(), split.begin(), split.end());
    }
    if (r.shape) {
      sizes_.scope(&r.let, nullptr, &b);
      if (r.shape->size() != t.shape.size()) {
        problem(t.name, fmt::format("{}: shape {} has {} axes; 'shape' says {}", rule_where(r),
                                    dims(t.shape), t.shape.size(), r.shape->size()));
        return false;
      }
      for (size_t d = 0; d < t.shape.size(); ++d) {
        auto v = sizes_.eval((*r.shape)[d]);
        if (!v) {
          problem(t.name,
                  fmt::format("{}: shape axis {}: {}", rule_where(r), d, v.error().message));
          return false;
        }
        if (*v != t.shape[d]) {
          problem(first.name,
                  fmt::format("{}: axis {} of '{}' is {}, but '{}' is {} in {}", rule_where(r), d,
                              t.name, t.shape[d], (*r.shape)[d].text, *v, config_what_));
          return false;
        }
      }
    }
    if (!no_byte_twice(r, t, plans)) return false;
    // The runs, never more than what remains of the map's budget: a tensor that needs more is
    // refused before its runs outgrow it.
    const uint64_t left = kMaxRunsTotal - total_runs_;
    const uint64_t limit = std::min(kMaxRunsPerTensor, left);
    if (r.transpose) return emit_transposed(r, plans[0], t, limit, left);
    uint64_t out_elem = 0;
    for (const auto& plan : plans) {
      if (!emit(plan, out_elem, t.runs, limit)) {
        problem(t.name, limit < left
                            ? fmt::format("{}: '{}' needs more than {} runs", rule_where(r), t.name,
                                          kMaxRunsPerTensor)
                            : fmt::format("{} needs more than {} runs", where_, kMaxRunsTotal));
        t.runs = {};
        return false;
      }
      out_elem += plan.elems();
    }
    return true;
  }

  // A transposed part's runs: one per leading block of its [R, C] matrices, each reading the
  // matrix column by column (len 1, count R, stride C, reps C). A matrix with one row or one
  // column is its own transpose: its bytes are read as they lie.
  bool emit_transposed(const MapRule& r, const PartPlan& p, MappedTensor& t, uint64_t limit,
                       uint64_t left) {
    const uint64_t rows = t.shape.back();  // R: the stored matrix's rows, now its columns
    const uint64_t cols = t.shape[t.shape.size() - 2];
    const uint64_t mat = rows * cols;  // <= numel: no overflow
    if (mat == 0) return true;
    const uint64_t blocks = p.elems() / mat;
    if (blocks > limit) {
      problem(t.name, limit < left
                          ? fmt::format("{}: '{}' needs more than {} runs", rule_where(r), t.name,
                                        kMaxRunsPerTensor)
                          : fmt::format("{} needs more than {} runs", where_, kMaxRunsTotal));
      return false;
    }
    if (rows == 1 || cols == 1) {
      t.runs.push_back(MapRun{p.src, 0, p.base, p.elems(), 1, 0});
      return true;
    }
    t.runs.reserve(blocks);
    for (uint64_t b = 0; b < blocks; ++b) {
      t.runs.push_back(MapRun{p.src, b * mat, p.base + b * mat, 1, rows, cols, cols, 1});
    }
    return true;
  }

  // No stored element is read twice by one HF tensor. One part cannot (PartPlan), and parts of
  // other stored tensors cannot: only parts sharing a stored tensor are compared. Where their
  // hulls are disjoint that is all; otherwise their rows are expanded into blocks and sorted,
  // at most kMaxOverlapBlocks of them (beyond that the tensor is refused, naming the cap).
  bool no_byte_twice(const MapRule& r, const MappedTensor& t, const std::vector<PartPlan>& plans) {
    std::vector<size_t> order;
    for (size_t i = 0; i < plans.size(); ++i) {
      if (plans[i].elems() > 0) order.push_back(i);
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::tie(plans[a].src, plans[a].lo) < std::tie(plans[b].src, plans[b].lo);
    });
    for (size_t g = 0; g < order.size();) {
      size_t e = g + 1;
      bool meet = false;
      uint64_t hi = plans[order[g]].hi;
      for (; e < order.size() && plans[order[e]].src == plans[order[g]].src; ++e) {
        meet = meet || plans[order[e]].lo < hi;
        hi = std::max(hi, plans[order[e]].hi);
      }
      if (meet && !blocks_disjoint(r, t, plans, std::span(order).subspan(g, e - g))) return false;
      g = e;
    }
    return true;
  }

  // The exact check of parts of one stored tensor whose hulls meet.
  bool blocks_disjoint(const MapRule& r, const MappedTensor& t, const std::vector<PartPlan>& plans,
                       std::span<const size_t> parts) {
    const Tensor& s = stored_[plans[parts[0]].src];
    auto too_many = [&] {
      problem(s.name, fmt::format("{}: '{}' reads '{}' in parts whose rows interleave; checking "
                                  "that they read no element twice takes more than {} blocks",
                                  rule_where(r), t.name, s.name, kMaxOverlapBlocks));
      return false;
    };
    std::vector<std::pair<uint64_t, uint64_t>> blocks;  // (first element, elements)
    std::vector<MapRun> runs;
    for (size_t i : parts) {
      runs.clear();
      if (!emit(plans[i], 0, runs, kMaxOverlapBlocks)) return too_many();
      for (const auto& run : runs) {
        if (run.count > kMaxOverlapBlocks - blocks.size()) return too_many();
        for (uint64_t c = 0; c < run.count; ++c) {
          blocks.emplace_back(run.src_elem + c * run.stride, run.len);
        }
      }
    }
    std::sort(blocks.begin(), blocks.end());
    for (size_t i = 1; i < blocks.size(); ++i) {
      const auto [a0, n0] = blocks[i - 1];
      const auto [a1, n1] = blocks[i];
      if (a0 + n0 > a1) {
        problem(s.name, fmt::format("{}: '{}' reads elements {}..{} twice", rule_where(r), t.name,
                                    a1, std::min(a0 + n0, a1 + n1) - 1));
        return false;
      }
    }
    return true;
  }

  const format::ModelMap& map_;
  const nlohmann::json& config_;
  std::string_view config_what_;
  const std::vector<Tensor>& stored_;
  Sizes sizes_;
  std::unordered_map<std::string, uint32_t> by_name_;
  std::vector<bool> used_;
  std::vector<bool> when_dropped_;  // read by a rule whose `when` does not hold
  std::string where_;
  std::map<std::string, uint64_t> made_;  // HF pattern -> tensors made (alternatives' check)
  uint64_t total_runs_ = 0;
  uint64_t total_rows_ = 0;
  uint64_t total_bindings_ = 0;
  std::vector<std::pair<std::string, uint64_t>> for_counts_;  // the current rule's `for`
  CompiledMap out_;
};

}  // namespace

CompiledMap compile_map(const format::ModelMap& map, const nlohmann::json& config,
                        std::string_view config_what, const std::vector<Tensor>& stored) {
  return Compiler(map, config, config_what, stored).run();
}

}  // namespace ckptfs::layout

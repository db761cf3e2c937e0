// layout/map_sizes: the sizes a map rule reads by name: its captures, a part's and the rule's
// `let`, the map's `axes` (worked out on demand, cycles and deep nesting refused), then
// config.json.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/layout/map_config.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::layout {

// A rule's captures bound to values.
using Binding = std::vector<std::pair<std::string, uint64_t>>;

// Sizes: a rule's and a part's `let`, the map's `axes` (evaluated on demand, cycles refused),
// then config.json.
class Sizes {
 public:
  Sizes(const format::ModelMap& m, const nlohmann::json& config) : map_(m), config_(config) {}

  // Lets and axes may read captures and each other: what was worked out holds for one scope.
  void scope(const std::vector<std::pair<std::string, format::MapExpr>>* rule_let,
             const std::vector<std::pair<std::string, format::MapExpr>>* part_let,
             const Binding* b) {
    rule_let_ = rule_let;
    part_let_ = part_let;
    binding_ = b;
    cache_.clear();
  }

  Result<uint64_t> eval(const format::MapExpr& e) {
    err_.reset();
    auto r = format::eval_expr(e, [this](std::string_view n) { return lookup(n); });
    if (err_) return *err_;
    return r;
  }

  // A size by name, nullopt when unknown. A definition that fails (a cycle, an inexact
  // division) gives nullopt too and leaves its error in error(): callers that treat unknown
  // as "infer it" must check that first.
  std::optional<uint64_t> lookup(std::string_view n) {
    // Inside its own definition a name is config.json's: "head_dim": "head_dim | ...".
    if (!stack_.empty() && stack_.back() == n) return config_value(config_, n);
    if (std::find(stack_.begin(), stack_.end(), n) != stack_.end()) {
      if (!err_) err_ = make_error(EINVAL, "size '{}' is defined in terms of itself", n);
      return std::nullopt;
    }
    if (binding_) {
      for (const auto& [k, v] : *binding_) {
        if (k == n) return v;
      }
    }
    const format::MapExpr* def = nullptr;
    for (const auto* defs : {part_let_, rule_let_, &map_.axes}) {
      if (!defs || def) continue;
      for (const auto& [k, e] : *defs) {
        if (k == n) {
          def = &e;
          break;
        }
      }
    }
    if (!def) return config_value(config_, n);
    // Failures are kept too: a chain of unresolvable sizes is worked out once, not 2^n times.
    if (auto it = cache_.find(std::string(n)); it != cache_.end()) return it->second;
    auto v = nested(std::string(n), *def);
    cache_.emplace(std::string(n), v);
    return v;
  }

  [[nodiscard]] const std::optional<Error>& error() const { return err_; }
  void clear_error() { err_.reset(); }

 private:
  std::optional<uint64_t> nested(const std::string& name, const format::MapExpr& e) {
    if (stack_.size() > 32) {
      if (!err_) err_ = make_error(EINVAL, "size '{}' nests deeper than 32 definitions", name);
      return std::nullopt;
    }
    stack_.push_back(name);
    auto r = format::eval_expr(e, [this](std::string_view n) { return lookup(n); });
    stack_.pop_back();
    if (!r) {
      if (!err_ && r.error().code != ENOENT) {
        err_ = std::move(r).error().context(fmt::format("size '{}'", name));
      }
      return std::nullopt;
    }
    return *r;
  }

  const format::ModelMap& map_;
  const nlohmann::json& config_;
  const std::vector<std::pair<std::string, format::MapExpr>>* rule_let_ = nullptr;
  const std::vector<std::pair<std::string, format::MapExpr>>* part_let_ = nullptr;
  const Binding* binding_ = nullptr;
  std::unordered_map<std::string, std::optional<uint64_t>> cache_;  // this scope's sizes
  std::vector<std::string> stack_;                                  // definitions being worked out
  std::optional<Error> err_;
};

}  // namespace ckptfs::layout

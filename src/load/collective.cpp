// load/collective: the read-once-share-to-all plan (assign_balanced) and its thread-group form.
#include "ckptfs/load/collective.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

namespace ckptfs::load {
namespace {

class ThreadMember final : public Collective {
 public:
  ThreadMember(std::shared_ptr<ThreadGroup> g, unsigned r) : g_(std::move(g)), r_(r) {}
  [[nodiscard]] unsigned rank() const override { return r_; }
  [[nodiscard]] unsigned size() const override { return g_->ranks(); }

  Result<bool> all_ok(bool ok) override {
    {
      std::lock_guard lock(g_->mu);
      g_->flags[r_] = ok ? 1 : 0;
    }
    CKPTFS_CHECK(g_->barrier());
    bool all = true;
    {
      std::lock_guard lock(g_->mu);
      for (auto f : g_->flags) all = all && f;
    }
    CKPTFS_CHECK(g_->barrier());  // nobody writes flags again before everyone read them
    return all;
  }

  Result<bool> all_same(uint64_t value) override {
    {
      std::lock_guard lock(g_->mu);
      g_->values[r_] = value;
    }
    CKPTFS_CHECK(g_->barrier());
    bool same = true;
    {
      std::lock_guard lock(g_->mu);
      for (auto v : g_->values) same = same && v == g_->values[0];
    }
    CKPTFS_CHECK(g_->barrier());
    return same;
  }

  Status broadcast(void* buf, uint64_t bytes, unsigned root) override {
    if (root >= g_->ranks())
      return make_error(EINVAL, "broadcast from rank {} of {}", root, size());
    if (r_ == root) {
      std::lock_guard lock(g_->mu);
      g_->root_buf = buf;
    }
    CKPTFS_CHECK(g_->barrier());
    if (r_ != root && bytes > 0) {
      const void* from = nullptr;
      {
        std::lock_guard lock(g_->mu);
        from = g_->root_buf;
      }
      std::memcpy(buf, from, bytes);
    }
    return g_->barrier();  // the root's buffer stays valid until every rank has copied
  }

 private:
  std::shared_ptr<ThreadGroup> g_;
  unsigned r_;
};

}  // namespace

std::vector<unsigned> assign_balanced(const std::vector<uint64_t>& bytes, unsigned ranks) {
  std::vector<unsigned> owner(bytes.size(), 0);
  if (ranks <= 1) return owner;
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<uint64_t> load(ranks, 0);
  for (size_t i : order) {
    const auto r = static_cast<unsigned>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[r] += bytes[i];
  }
  return owner;
}

std::shared_ptr<ThreadGroup> ThreadGroup::create(unsigned ranks, unsigned timeout_ms) {
  auto g = std::make_shared<ThreadGroup>(ranks, timeout_ms);
  g->flags.assign(ranks, 0);
  g->values.assign(ranks, 0);
  return g;
}

std::unique_ptr<Collective> ThreadGroup::member(unsigned r) {
  return std::make_unique<ThreadMember>(shared_from_this(), r);
}

Status ThreadGroup::barrier() {
  std::unique_lock lock(mu);
  if (broken_) return make_error(ETIMEDOUT, "thread group: a rank did not arrive");
  const uint64_t gen = generation_;
  if (++arrived_ == ranks_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return {};
  }
  const bool woke = cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms_),
                                 [&] { return generation_ != gen || broken_; });
  if (!woke || generation_ == gen) {
    broken_ = true;
    cv_.notify_all();
    return make_error(ETIMEDOUT, "thread group: a rank did not arrive within {} ms", timeout_ms_);
  }
  return {};
}

}  // namespace ckptfs::load

// fs/resplits: the queue and the threads of the splits after close (see the header).
#include "resplits.hpp"

#include <algorithm>

namespace ckptfs::fs {

Resplits::Resplits(std::function<void(write::ResplitJob&)> run, unsigned workers)
    : run_(std::move(run)), workers_(workers ? workers : default_workers()) {}

unsigned Resplits::default_workers() {
  return std::clamp(std::thread::hardware_concurrency() / 4, 1u, 4u);
}

Resplits::~Resplits() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : threads_) t.join();
}

void Resplits::post(write::ResplitJob job) {
  std::unique_lock lock(mu_);
  room_.wait(lock, [&] { return queue_.size() < kMaxQueued; });
  queue_.push_back(std::move(job));
  while (threads_.size() < workers_) threads_.emplace_back([this] { loop(); });
  lock.unlock();
  work_.notify_one();
}

size_t Resplits::pending() const {
  std::lock_guard lock(mu_);
  return queue_.size() + busy_.size();
}

size_t Resplits::running() const {
  std::lock_guard lock(mu_);
  return busy_.size();
}

void Resplits::drain() {
  std::unique_lock lock(mu_);
  room_.wait(lock, [&] { return queue_.empty() && busy_.empty(); });
}

std::deque<write::ResplitJob>::iterator Resplits::runnable() {
  return std::find_if(queue_.begin(), queue_.end(), [&](const write::ResplitJob& j) {
    return !busy_.count(Key{static_cast<uint64_t>(j.dev), static_cast<uint64_t>(j.ino)});
  });
}

void Resplits::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    // Stopping ends a worker only once nothing is queued: unmount waits for all of it.
    work_.wait(lock, [&] { return (stop_ && queue_.empty()) || runnable() != queue_.end(); });
    const auto it = runnable();
    if (it == queue_.end()) return;
    write::ResplitJob job = std::move(*it);
    queue_.erase(it);
    const Key key{static_cast<uint64_t>(job.dev), static_cast<uint64_t>(job.ino)};
    busy_.insert(key);
    lock.unlock();
    room_.notify_all();
    run_(job);
    lock.lock();
    busy_.erase(key);
    room_.notify_all();
    work_.notify_all();  // a split of the same file may be runnable now, or the queue empty
  }
}

void SplitStamps::expect(uint64_t dev, uint64_t ino, const Stamp& s) {
  std::lock_guard lock(mu_);
  expected_[{dev, ino}] = s;
}

void SplitStamps::changed(uint64_t dev, uint64_t ino, const Stamp& before, const Stamp& after) {
  std::lock_guard lock(mu_);
  auto it = expected_.find({dev, ino});
  if (it != expected_.end() && it->second == before) it->second = after;
}

std::optional<SplitStamps::Stamp> SplitStamps::take(uint64_t dev, uint64_t ino) {
  std::lock_guard lock(mu_);
  auto it = expected_.find({dev, ino});
  if (it == expected_.end()) return std::nullopt;
  Stamp s = it->second;
  expected_.erase(it);
  return s;
}

}  // namespace ckptfs::fs

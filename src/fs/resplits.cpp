// fs/resplits: the queue and the thread of the splits after close (see the header).
#include "resplits.hpp"

namespace ckptfs::fs {

Resplits::~Resplits() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Resplits::post(write::ResplitJob job) {
  std::unique_lock lock(mu_);
  room_.wait(lock, [&] { return queue_.size() < kMaxQueued; });
  queue_.push_back(std::move(job));
  if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
  lock.unlock();
  work_.notify_one();
}

size_t Resplits::pending() const {
  std::lock_guard lock(mu_);
  return queue_.size() + (running_ ? 1 : 0);
}

void Resplits::drain() {
  std::unique_lock lock(mu_);
  room_.wait(lock, [&] { return queue_.empty() && !running_; });
}

void Resplits::loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and nothing left: unmount waited for all of it
    write::ResplitJob job = std::move(queue_.front());
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    room_.notify_all();
    run_(job);
    lock.lock();
    running_ = false;
    room_.notify_all();
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

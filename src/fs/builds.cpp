// fs/builds: view builds off the FUSE workers' path: the builder threads, a directory's build
// claimed and run, and the requests parked on it (Filesystem::when_ready) until it ends.
#include "builds.hpp"

#include <fcntl.h>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "impl.hpp"
#include "names.hpp"

namespace ckptfs::fs {

bool BuildPool::submit(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    if (idle_ <= queue_.size() && threads_.size() < max_) {
      // Every thread is busy (or already has a job coming): one more, if one can be started.
      if (auto st = threads_.spawn([this] { run(); }); !st) {
        spdlog::warn("view builds: {} builder thread(s) of {}: {}", threads_.size(), max_,
                     st.error().message);
      }
    }
    if (threads_.size() == 0) return false;
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void BuildPool::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  threads_.join();
}

void BuildPool::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      job();
    } catch (const std::exception& e) {
      spdlog::error("view build: {}", e.what());
    } catch (...) {
      spdlog::error("view build: unknown exception");
    }
  }
}

// --- a build, claimed and run -------------------------------------------------------------

DirViews::BuildJob DirViews::claim_locked(DirState& st, const std::string& rel, Ino dir_ino) {
  st.building = true;
  return BuildJob{st.entries, st.sig, st.dst, st.settled, st.view, rel, dir_ino};
}

std::shared_ptr<const View> DirViews::run_build(const std::shared_ptr<DirState>& st,
                                                const BuildJob& job, Resumes& resumes) {
  std::unique_lock lock(st->mu, std::defer_lock);
  // However the build ends, even by an exception, it ends: `building` is cleared, the waiters
  // are woken (they build again if nothing was installed) and the parked requests are handed
  // back. Nothing stays pinned.
  struct EndBuild {
    DirState& st;
    std::unique_lock<std::mutex>& lock;
    Resumes& resumes;
    ~EndBuild() {
      if (!lock.owns_lock()) lock.lock();
      st.building = false;
      resumes.swap(st.parked);
      st.built.notify_all();
    }
  } end_build{*st, lock, resumes};
  if (d_.opts.on_build) d_.opts.on_build(job.rel);  // a test's seam: it may block, or throw
  std::shared_ptr<const View> v;
  if (auto dirfd = open_beneath(d_.root, job.rel, O_RDONLY | O_DIRECTORY); dirfd) {
    auto ck = source::load_checkpoint(dirfd->get(), job.entries, source_path(job.rel), d_.headers,
                                      d_.opts.build);
    d_.status.builds.fetch_add(1, std::memory_order_relaxed);
    if (!ck->valid()) d_.status.refusals.fetch_add(1, std::memory_order_relaxed);
    log_build(job.rel, *ck);
    v = make_view(std::move(ck), job.rel, job.dst, job.sig, job.entries, job.settled);
  }
  lock.lock();
  if (!v) return st->view;  // the directory went away: try again on the next access
  // The check is skipped while building, so the inputs are still those just read.
  st->view = v;
  st->view_sig = job.sig;
  st->needs_build = false;
  announce(job.old, v, job.rel, job.dir_ino);
  return v;
}

void DirViews::resume(Resumes& resumes) {
  for (auto& r : resumes) {
    // Off the calling thread where it is a FUSE worker (view_of's caller): each parked request
    // may wait in its turn (settle).
    if (builders_ && builders_->submit(r)) continue;
    r();
  }
  resumes.clear();
}

bool DirViews::when_ready(Ino dir_ino, std::string_view name,
                          const std::function<void()>& resume_fn) {
  start();
  if (!builders_) return true;
  // Only consolidated names, config.json (which the view may supply or hide), the adapter folder
  // and listings need the current view (namespace.cpp).
  if (!name.empty() && !names::needs_view(name)) return true;
  auto n = d_.nodes.get(dir_ino);
  if (!n || n->kind != Kind::Dir) return true;
  auto dst = stat_beneath(d_.root, n->rel);
  if (!dst) return true;  // the request itself answers the error
  auto st =
      d_.nodes.dir_state(static_cast<uint64_t>(dst->st_dev), static_cast<uint64_t>(dst->st_ino));
  std::unique_lock lock(st->mu);
  if (st->building) {
    st->parked.push_back(resume_fn);
    return false;
  }
  check_locked(*st, n->rel, *dst, dir_ino);
  if (!st->needs_build) return true;
  BuildJob job = claim_locked(*st, n->rel, dir_ino);
  st->parked.push_back(resume_fn);
  lock.unlock();
  auto build = [this, st, job = std::move(job)] {
    Resumes resumes;
    try {
      run_build(st, job, resumes);
    } catch (const std::exception& e) {
      spdlog::error("{}: view build: {}", source_path(job.rel), e.what());
    }
    for (auto& r : resumes) r();  // on this builder thread: the view is current now
  };
  if (!builders_->submit(build)) build();  // stopping, or no thread: here, as before
  return false;
}

void DirViews::stop_builds() {
  if (builders_) builders_->stop();
}

}  // namespace ckptfs::fs

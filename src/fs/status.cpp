// fs/status: the daemon's status directory (.ckptfs/ at the root, never listed) and the content of
// its status.json, made at each open from the figures StatusFile gathers.
#include "status.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "impl.hpp"

namespace ckptfs::fs {
namespace {

constexpr std::string_view kStatusKeyDir = "dir";  // the status directory's key name

}  // namespace

void StatusFile::set_extra(StatusExtra extra) {
  std::lock_guard lock(mu_);
  extra_ = std::move(extra);
}

void StatusFile::note_error(int err) {
  errors.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(mu_);
  if (by_errno_.size() < 64 || by_errno_.count(err)) by_errno_[err]++;
}

StatusFile::Snapshot StatusFile::snapshot() const {
  Snapshot s;
  std::lock_guard lock(mu_);
  if (extra_) s.extra = extra_();
  s.by_errno = by_errno_;
  return s;
}

struct stat Filesystem::Impl::status_attr(const Node& n) const {
  struct stat st {};
  st.st_ino = virtual_ino(0, 0, 0, n.key.name) | (1ull << 62);
  st.st_uid = ::geteuid();
  st.st_gid = ::getegid();
  set_times(st, status.started_ns);
  st.st_blksize = 4096;
  if (n.kind == Kind::StatusDir) {
    st.st_mode = S_IFDIR | 0555;
    st.st_nlink = 2;
  } else {
    // The mount's owner's alone (and root's): it names what the daemon serves, private
    // directories included. Size 0: made at open, read with direct I/O.
    st.st_mode = S_IFREG | 0400;
    st.st_nlink = 1;
  }
  return st;
}

Result<EntryOut> Filesystem::Impl::lookup_status(Ino parent, Kind kind, std::string_view name) {
  Node proto;
  proto.kind = kind;
  const std::string key_name(kind == Kind::StatusDir ? kStatusKeyDir : kStatusFileName);
  Node n = nodes.remember(Key{Space::Status, 0, 0, 0, 0, key_name}, std::move(proto), parent, name);
  return EntryOut{n.ino, status_attr(n)};
}

std::string Filesystem::Impl::status_json() const {
  using nlohmann::json;
  json out;
  out["version"] = CKPTFS_VERSION;
  out["source"] = source;
  out["pid"] = ::getpid();
  out["uptime_s"] = (clock->realtime_ns() - status.started_ns) / kNsPerSec;
  out["read_only"] = opts.read_only;

  // Checkpoint directories the daemon tracks now (those the kernel holds an inode of).
  std::vector<std::shared_ptr<DirState>> dirs = nodes.dirs();
  json list = json::array();
  std::map<std::string, uint64_t> by_state;
  for (auto& d : dirs) {
    std::shared_ptr<const View> v;
    bool unread = false;
    {
      std::lock_guard lock(d->mu);
      v = d->view;
      unread = d->needs_build || d->building;
    }
    if (!v) continue;  // not a checkpoint directory
    json c;
    c["path"] = source_path(v->rel);
    std::string state = v->complete ? "serving" : v->settling ? "settling" : "refused";
    if (state == "refused" && unread) state = "unread";  // shards' headers not read (yet)
    c["state"] = state;
    if (!v->ckpt->map.empty()) c["map"] = v->ckpt->map;
    if (v->ckpt->unmapped_native()) {
      // Served under a trainer's own names: why no built-in map fits (no config.json shown).
      c["unmapped_native"] = {{"name", v->ckpt->native_name}, {"maps_tried", v->ckpt->map_trials}};
    }
    if (state == "serving") {
      c["files"] = v->ckpt->outputs.size();
      c["tensors"] = v->ckpt->tensors.size();
      uint64_t bytes = 0;
      for (const auto& o : v->ckpt->outputs) bytes += o.size;
      c["bytes"] = bytes;
    }
    if (state == "refused") {
      json problems = json::array();
      for (const auto& p : v->ckpt->problems) {
        if (problems.size() == 16) break;
        problems.push_back(p.to_string());
      }
      c["problems"] = std::move(problems);
      c["problem_count"] = v->ckpt->problems.size();
    }
    by_state[state]++;
    list.push_back(std::move(c));
  }
  std::sort(list.begin(), list.end(),
            [](const json& a, const json& b) { return a["path"] < b["path"]; });
  json ck;
  ck["tracked"] = list.size();
  for (const char* st : {"serving", "settling", "refused", "unread"}) ck[st] = by_state[st];
  ck["built_total"] = status.builds.load();
  ck["refused_total"] = status.refusals.load();
  ck["list"] = std::move(list);
  out["checkpoints"] = std::move(ck);

  out["reads"] = {{"requests", status.reads.load()},
                  {"bytes", status.bytes_read.load()},
                  {"backed_opens", io_modes.backed_opens()}};
  // "passthrough": files opened for writing are written by the kernel itself (the mount's
  // write path, docs/semantics.md); "backed_opens": how many such opens there were;
  // "requests" and "bytes": the WRITE requests that reached the daemon; "splits_pending": files
  // closed and stored as one shard whose split into rank shards is queued or running;
  // "splits_running": those running; "split_threads": how many may (-o split_threads).
  out["writes"] = {{"open_files", writing.open_files()},
                   {"splits_pending", writing.pending_splits()},
                   {"splits_running", writing.running_splits()},
                   {"split_threads", writing.split_threads()},
                   {"passthrough", backs_writes()},
                   {"backed_opens", io_modes.backed_writes()},
                   {"requests", status.writes.load()},
                   {"bytes", status.bytes_written.load()}};

  json extra = json::object();
  json errs = json::object();
  {
    const auto snap = status.snapshot();
    for (const auto& [k, v] : snap.extra) extra[k] = v;
    for (const auto& [e, n] : snap.by_errno) {
      const char* name = ::strerrorname_np(e);
      errs[name ? std::string(name) : std::to_string(e)] = n;
    }
  }
  out["prefetch"] = std::move(extra);
  out["errors"] = {{"total", status.errors.load()}, {"by_errno", std::move(errs)}};
  out["cache"] = {{"header_bytes", headers.bytes()}, {"shard_fds_open", open_shard_fds.load()}};
  return out.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

}  // namespace ckptfs::fs

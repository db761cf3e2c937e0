// The flusher: where the shard bytes of a file written through the mount go, and how they
// become its stored form. The write router (write/) only produces (rank, offset, bytes); a
// Flusher decides where each rank's file lives: in the local directory from this process
// (LocalFlusher), or on the node that owns the rank (the OpenMPI flusher, flush/mpi.hpp, which
// wraps a LocalFlusher for the staging and the commit and moves only the bytes).
//
// Stored form of a file `name` in directory D (see format/record.hpp):
//   D/shard-{r:05d}-model-{k:05d}-of-{m:05d}.safetensors   one per rank
//   D/.ckptfs/<name>.commit                                the commit record, written last
// While a file is written its shards are staged in D/.ckptfs/tx-*/ (rank-00001, ...), locked
// with flock by the daemon writing them. Commit: the record is renamed into place (the commit
// point), then the staged shards are renamed over the final names (roll forward), then the
// staging directory is removed. A crash before the record's rename leaves the old version;
// after it, the new one (recover() finishes the roll forward).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/record.hpp"
#include "ckptfs/io/shard_io.hpp"
#include "ckptfs/layout/shard_set.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::flush {

// The directory a file lives in, held open by the caller for the duration of the call (and,
// for begin(), by the transaction, which dups it).
struct Target {
  int dirfd = -1;
  std::string display;  // the directory's path, for messages
  // Owner and mode the shard files get (the file's own).
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0644;
  // The inode of the file being written, whose backing file is an empty placeholder while
  // its bytes go to the shards: recover() removes it with the staging of a dead writer.
  ino_t placeholder = 0;
  // The kernel writes that file itself (write passthrough), so it is not empty: recover()
  // removes it from under a model name instead (its writer never closed it; see
  // Flusher::begin_kernel_write).
  bool kernel_written = false;
};

struct CommitInfo {
  std::string name;  // model.safetensors or model-0000k-of-0000m.safetensors
  uint32_t k = 1, m = 1;
  std::string header;  // the file's original 8 + N bytes
  uint64_t size = 0;   // the file's size
  // The file's owner and permission bits, written into the record (the view of node-local
  // shards shows and enforces them).
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0600;
  // The file's access and modification times (`times` set): given to its shard files, or to
  // the record of node-local shards, which the view takes them from.
  bool times = false;
  struct timespec atime {
  }, mtime{};
  // Set by a flusher whose shards live elsewhere (node-local targets): the record lists these
  // (owner, path, header) instead of the staged shards, and none is moved into the directory.
  std::vector<format::RecordShard> remote_shards;

  // A file's commit, with its owner, permission bits and times taken from `st` (its fstat).
  static CommitInfo of(std::string name, uint32_t k, uint32_t m, std::string header, uint64_t size,
                       const struct stat& st) {
    CommitInfo c;
    c.name = std::move(name);
    c.k = k;
    c.m = m;
    c.header = std::move(header);
    c.size = size;
    c.uid = st.st_uid;
    c.gid = st.st_gid;
    c.mode = st.st_mode & 07777;
    c.times = true;
    c.atime = st.st_atim;
    c.mtime = st.st_mtim;
    return c;
  }
};

// One file's shards, staged and then committed. Not thread-safe: its WriteFile serializes.
class Transaction : public io::ShardSink {
 public:
  // Makes the staged shard bytes durable (fsync).
  virtual Status sync() = 0;
  // Makes the shards the stored form of `info.name` in the target directory (see above);
  // `durable`: fsync the shards, the record and the directories too. Reads keep working after.
  virtual Status commit(const CommitInfo& info, bool durable) = 0;
  // Reads n bytes at `off` of rank `rank`'s shard file (staged or committed).
  virtual Status pread(uint32_t rank, uint64_t off, char* dst, size_t n) = 0;
  // Applies the file's owner and mode to the shard files.
  virtual Status set_owner(uid_t uid, gid_t gid, mode_t mode) = 0;
  // Removes the staged shards (nothing is committed). Idempotent; the destructor aborts an
  // uncommitted transaction.
  virtual void abort() = 0;
  // The staging directory's name under D/.ckptfs (tx-...), where the staged shards are
  // rank-00001...: for a flusher whose shard bytes are written by other processes (the
  // OpenMPI flusher opens them by this path on the owning rank). Empty where there is none.
  [[nodiscard]] virtual std::string staging_name() const { return {}; }
  // Makes file `name` of directory `dirfd` (same file system) rank `rank`'s staged shard as it
  // is, by a hard link, in place of the sized empty one begin() made: no byte is copied. The
  // file must be the shard, header and all (begin()'s shard set says so). The file keeps its
  // name until commit() (the commit removes nothing; the caller unlinks the name after). Only
  // where Flusher::adopts_files().
  // `ino`: the file's inode (EIO if the name holds another file by then).
  virtual Status adopt(uint32_t rank, int dirfd, const std::string& name, ino_t ino) {
    (void)rank, (void)dirfd, (void)ino;
    return make_error(ENOTSUP, "{}: this flusher copies every shard", name);
  }
};

class Flusher {
 public:
  virtual ~Flusher() = default;
  // Shards per file when the mount does not say (-o ranks=N).
  [[nodiscard]] virtual uint32_t default_ranks() const = 0;
  // Whether a file can be stored by hard links (Transaction::adopt of in_place()'s
  // transactions): its one shard is itself, or shards already in SRC.
  [[nodiscard]] virtual bool adopts_files() const { return false; }
  // The flusher that stores into the file's own directory in SRC: this one, or the local one
  // an OpenMPI flusher wraps (whose own transactions send the bytes to the ranks' owners).
  virtual Flusher& in_place() { return *this; }
  // Whether the shards begin() stages end in the file's own directory in SRC (false: on the
  // ranks' node-local targets, so a file stored at close as its one shard moves there after).
  [[nodiscard]] virtual bool shards_in_place() const { return true; }
  // Stages a new shard set: one file per rank, sized and holding nothing yet.
  virtual Result<std::unique_ptr<Transaction>> begin(const Target& t, const layout::ShardSet& set,
                                                     std::string what) = 0;
  // A file under a model name that the kernel writes itself (t.placeholder, t.kernel_written):
  // a staging with no shards, held until the returned transaction goes (the writer closed
  // the file). If the daemon dies first, recover() removes the file, as it removes a dead
  // writer's placeholder: its bytes were never stored, and it may read as complete with
  // zeros where the writer never wrote.
  virtual Result<std::unique_ptr<Transaction>> begin_kernel_write(const Target& t,
                                                                  std::string what) = 0;
  // Finishes what a crashed writer left in the directory: completes commits whose record
  // exists, removes staging without one (and its empty placeholder). Staging that a live
  // daemon holds is left alone. Returns whether it changed anything in the directory.
  virtual bool recover(const Target& t) = 0;
  // Removes the stored form of file k of m: its shards and commit records.
  virtual Status remove(const Target& t, uint32_t k, uint32_t m) = 0;
  // Reads the shards this flusher stores outside the source; null when it stores none there.
  [[nodiscard]] virtual std::shared_ptr<const io::ShardReader> reader() const { return nullptr; }
};

// Removes `name` under directory `parent`, and everything in it when it is a directory; no
// symlink is followed and at most a few levels are descended (the write path's state and a
// checkpoint's hidden files are flat).
void remove_tree(int parent, const std::string& name);

// Shards written from this process into the file's own directory, by the calling thread.
std::unique_ptr<Flusher> make_local_flusher();

}  // namespace ckptfs::flush

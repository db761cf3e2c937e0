// fs/node_table: the inode table (what each FUSE inode number stands for), the inode number
// allocator, the names the kernel may cache, and the directory states; and the lock order of fs.
//
// Lock order of the fs locks: take a lock on the left before one on its right, never the reverse.
//
//   DirState::mu (one directory's view)  ->  NodeTable::mu_ (this table)
//   DirState::mu                          ->  WriteRegistry::mu_  ->  a write::WriteFile's own lock
//   DirState::mu                          ->  the header cache's, the close watch's and the
//                                             notifier's own locks (leaves)
//   StatusFile::mu_                       ->  the StatusExtra source's own lock (the prefetcher)
//
// Leaves (no other fs lock is taken while one is held): NodeTable::mu_, Handles::mu_, View::fd_mu,
// WriterViews::mu_, ManualClock::mu_, SplitStamps::mu_. No two DirState::mu are held at once.
// A thread never waits on the kernel while it holds any of them (Notifier::sync is called with
// none held).
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/layout/checkpoint.hpp"

namespace ckptfs::fs {

struct View;
struct DirState;

// What a node is. StatusDir, StatusFile: .ckptfs/ at the root of the mount and its status.json.
// AdapterDir: a LoRA checkpoint's adapter folder (one View's, like Output and Index).
enum class Kind : uint8_t {
  Dir,
  File,
  Symlink,
  Other,
  Output,
  Index,
  ShardsDir,
  Pending,
  StatusDir,
  StatusFile,
  AdapterDir
};

// Which kind of identity a Key holds.
enum class Space : uint8_t {
  Real,       // a file of SRC: (fmt, dev, ino)
  Virtual,    // a synthesized file or folder of one View: (dev, ino) of its directory, generation,
              // name (a file in the adapter folder: "folder/name")
  ShardsDir,  // the .shards folder of a directory: (dev, ino) of that directory
  Status,     // the status directory and file: their name
};

// What a FUSE inode number stands for. Numbers are handed out on lookup and retired when the
// kernel forgets them, so the table holds only what the kernel holds.
struct Key {
  Space space = Space::Real;
  uint32_t fmt = 0;  // S_IFMT of a real node: a backing number reused for another type is another
                     // node (ext4 gives a deleted file's number to the next directory)
  uint64_t dev = 0, ino = 0, gen = 0;
  std::string name;
  auto operator<=>(const Key&) const = default;
};

struct Node {
  Ino ino = 0;
  Key key;
  Kind kind = Kind::Other;
  std::string rel;  // backing path (real nodes) or the checkpoint directory (virtual, .shards)
  uint64_t dev = 0, bino = 0;        // backing identity (real nodes and .shards' directory)
  std::shared_ptr<const View> view;  // Output / Index / AdapterDir
  uint32_t output = 0;
  uint64_t nlookup = 0;
  layout::FileStamp cached;  // stamp when last opened: decides keep_cache
  // (parent, name) pairs it was looked up under: the entries the kernel may cache for it.
  std::vector<std::pair<Ino, std::string>> links;
  // Its backing file is gone for good (unlinked through the mount, or a placeholder removed
  // at commit): its number may name another file now, which must never take this node over.
  bool retired = false;
  // A synthesized file of a version that a write through the mount replaced (committed under
  // its name): an open of it answers ESTALE, so that the kernel looks the name up again and
  // opens the new version, never this one's bytes from shard fds its readers keep open.
  bool superseded = false;
};

Kind kind_of(mode_t m);
// The key of a real file as stat'ed.
Key real_key(const struct stat& st);
// st_ino of a synthesized entry: one number per version of each name.
uint64_t virtual_ino(uint64_t dev, uint64_t ino, uint64_t gen, std::string_view name);

class NodeTable {
 public:
  struct Sizes {
    size_t nodes = 0, keys = 0, dirs = 0;
  };

  // Installs the root directory (once, before any other call); its device numbers st_ino.
  void set_root(Node root);

  // st_ino of a real file: its backing number on the source's own device, so it is stable
  // for as long as the file exists whatever the kernel forgets; a hash on other devices.
  [[nodiscard]] uint64_t shown_ino(uint64_t dev, uint64_t ino) const;

  // A copy of the node, taken under the lock (rel may change when the source is renamed).
  [[nodiscard]] std::optional<Node> get(Ino ino) const;
  // Registers (or finds) the node for `key`, looked up as `name` in directory `parent`, counts
  // one lookup, and returns a copy.
  Node remember(const Key& key, Node proto, Ino parent, std::string_view name);
  // The kernel dropped `n` lookups of `ino`. At zero its number, its names and, for a
  // directory, its state go; that state is returned (to be released after this lock).
  std::shared_ptr<DirState> forget(Ino ino, uint64_t n);

  // Records the stamp a plain file was opened with; returns whether it matches the last one.
  bool swap_cached_stamp(Ino ino, const layout::FileStamp& stamp);
  // Node `ino` is found at `rel` from now on (another of its hard links).
  void set_rel(Ino ino, const std::string& rel);
  // Renames the nodes under `old_rel` to `new_rel` (and the reverse for an exchange), and the
  // cached name (op, oname) to (np, nname).
  void renamed(Ino op, const std::string& oname, const std::string& old_rel, Ino np,
               const std::string& nname, const std::string& new_rel, bool exchange);
  // Node `ino` is again what the kernel may hold under (parent, name), found at `rel`: the file
  // a rename replaced, put back when the rename was undone (renamed() moved its name and path).
  void put_back(Ino ino, Ino parent, const std::string& name, const std::string& rel);
  // The backing file of real node `ino` is gone for good: ext4 hands its number to the next
  // file made, which must get a node of its own (with the key kept, a lookup of that file
  // would take this node over, and the kernel's names for this one would show that file).
  // For a synthesized file's node: a committed write replaced the version it shows
  // (Node::superseded).
  void retire(Ino ino);
  // The same for the node that `key` names now, if any.
  void retire_key(const Key& key);

  // The node the kernel may hold under (parent, name).
  [[nodiscard]] std::optional<Node> child(Ino parent, const std::string& name) const;
  // Calls `fn(name, node)` for each name under `dir` the kernel may hold (node null when the
  // number is gone), under the lock: `fn` takes no lock.
  void for_each_kid(Ino dir, const std::function<void(const std::string&, const Node*)>& fn) const;

  // The state of directory (dev, ino), made on first use.
  std::shared_ptr<DirState> dir_state(uint64_t dev, uint64_t ino);
  // The state of directory (dev, ino) if it has one.
  [[nodiscard]] std::shared_ptr<DirState> find_dir(uint64_t dev, uint64_t ino) const;
  // Every directory state now.
  [[nodiscard]] std::vector<std::shared_ptr<DirState>> dirs() const;

  [[nodiscard]] Sizes sizes() const;

 private:
  void retire_locked(Ino ino);

  uint64_t root_dev_ = 0;  // set once by set_root, before any other thread runs

  mutable std::mutex mu_;  // guards every field below; a leaf (see the lock order above)
  std::unordered_map<Ino, std::shared_ptr<Node>> nodes_;
  std::map<Key, Ino> keys_;      // the inode number of every node the kernel holds
  Ino next_ino_ = kRootIno + 1;  // never reused: a retired number never names another file
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<DirState>> dirs_;
  // (parent, name) -> the node the kernel may hold under that name: a listing that no
  // longer shows it tells the kernel to drop the entry (see Impl::drop_vanished).
  std::map<std::pair<Ino, std::string>, Ino> kids_;
};

}  // namespace ckptfs::fs

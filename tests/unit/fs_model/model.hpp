// fs_model/model: the reference model of the tree (entries, writers, documented rules), the op
// record, and what each op must answer and leave.
//
// The model is what a POSIX directory would hold, with ckptfs's documented deviations
// (docs/semantics.md, "Writes") encoded where they apply; each is marked "semantics.md:" in
// model.cpp. It knows nothing of how an op reaches ckptfs except one bit: whether the kernel
// sits in between (a real mount), where the kernel answers some requests itself (each such case
// is marked "kernel:").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ckptfs::fsmodel {

// Coverage: how often each operation and state was reached, over all sequences.
using Counters = std::map<std::string, uint64_t>;

struct Dir;

// A file open for writing (one create's handle).
struct Handle {
  int id = 0;
  Dir* dir = nullptr;   // null once its name is gone (unlinked or replaced): an orphan
  Dir* home = nullptr;  // where it was created (its write state lives there)
  // An orphan's last name and directory.
  Dir* last_dir = nullptr;
  std::string last_name;
  std::string name;
  std::string target;  // the bytes the writer means to write
  bool tensors = false;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // (offset, length), in write order
  size_t next = 0;
  std::string buf;  // what it wrote so far (holes read as zeros)
  bool in_order = true;
  bool flushed = false;  // a FLUSH (a dup'd descriptor closed) or fsync while still open
  [[nodiscard]] bool complete() const { return next == pieces.size(); }
};

struct Entry {
  enum Kind { File, Writing, Directory } kind = File;
  // File: its bytes; whether they are a consolidated safetensors file, and whether it is stored
  // as rank shards (a commit record) rather than whole.
  std::string bytes;
  bool tensors = false;
  bool stored = false;
  // File, stored: a writer renamed over it that has not closed yet (semantics.md: the stored
  // version reads back under the name until the new one commits).
  int pending = -1;
  int handle = -1;           // Writing
  std::unique_ptr<Dir> dir;  // Directory
};

struct Dir {
  // Which model names the generator uses here: 0 none (the root), 1 model.safetensors,
  // 2 model-0000k-of-00002.safetensors (so every file of a directory has the same file count).
  int family = 0;
  std::map<std::string, Entry> entries;
};

extern const std::vector<std::string> kPlainNames;
extern const std::vector<std::string> kTempNames;
extern const std::vector<std::string> kDirNames;
std::vector<std::string> model_names(int family);
bool is_model(const std::string& name);

// One step of a sequence, as the generator chose it and the replay log prints it. Directories
// are named by their name at the root ("" is the root itself).
struct Op {
  enum Kind {
    None,         // nothing this step (the generator's pick did not apply)
    Create,       // open(dir/name, flags, 0644): a new writer `handle` (content, pieces)
    Write,        // pwrite of the handle's target [off, off + len)
    Close,        // close(): FLUSH then RELEASE
    Flush,        // a dup'd descriptor closed: FLUSH, the file still open
    Fsync,        // fsync (flags 1: fdatasync)
    Rename,       // renameat2(dir/name, to_dir/to_name, flags) of a file name
    RenameDir,    // renameat2(name, to_name, flags) at the root; leftover: see SrcLeftover first
    Unlink,       // unlink(dir/name)
    Mkdir,        // mkdir(name) at the root (family: the model family it gets)
    Rmdir,        // rmdir(name) at the root
    SrcWrite,     // SRC/dir/name written directly (bytes), then time passes
    SrcDelete,    // SRC/dir/name removed directly, then time passes
    SrcLeftover,  // SRC/to_name/.ckptfs/staging made directly (what a killed daemon leaves)
    Wait,         // time passes: past settle and revalidate
  } kind = None;
  std::string dir, name;
  std::string to_dir, to_name;
  int handle = 0;
  int flags = 0;  // Create: open flags; Rename, RenameDir: renameat2 flags; Fsync: 1 datasync
  bool tensors = false;  // Create: a consolidated safetensors file (else plain bytes)
  bool in_order = true;  // Create: pieces in file order
  std::string bytes;     // Create: the target; SrcWrite: the content
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // Create: (offset, length) in write order
  uint64_t off = 0, len = 0;                          // Write
  int family = 0;                                     // Mkdir
  bool leftover = false;                              // RenameDir: SrcLeftover of to_name first
  std::string where;  // Close, Flush: the handle's name then ("d0/model.safetensors", "orphan")
  bool incomplete = false;  // Close: not every piece written
  [[nodiscard]] std::string describe() const;
};

// What an op must answer: success (0) or the errno, and the case (for the message).
struct Expect {
  int err = 0;
  std::string what;
};

// What the runner checks in SRC once an op succeeded.
struct Effect {
  // A closed (or moved) file: stored as rank shards and no real file, or whole.
  std::optional<std::pair<std::string, std::string>> stored_as;  // (directory, name)
  // A consolidated file unlinked: none of its shards left.
  std::optional<std::pair<std::string, std::string>> shards_gone;
};

class Model {
 public:
  Model(std::string src, Counters& cov) : src_(std::move(src)), cov_(cov) {}

  Dir root;
  std::map<int, std::unique_ptr<Handle>> handles;
  int next_id = 1;

  // --- queries ---
  [[nodiscard]] std::string src_path(const std::string& dname) const {
    return dname.empty() ? src_ : src_ + "/" + dname;
  }
  // The directories, by name ("" is the root).
  [[nodiscard]] std::vector<std::string> dir_names() const;
  Dir& dir(const std::string& dname) { return dname.empty() ? root : *root.entries.at(dname).dir; }
  [[nodiscard]] const Dir& dir(const std::string& dname) const {
    return dname.empty() ? root : *root.entries.at(dname).dir;
  }
  [[nodiscard]] std::string name_of(const Dir* d) const;
  Handle& handle(int id) { return *handles.at(id); }
  [[nodiscard]] const Handle& handle(int id) const { return *handles.at(id); }
  // Names of a directory the generator uses for files.
  static std::vector<std::string> file_names(const Dir& d);
  // A directory at the root (the first two of a sequence, made before its first step).
  void add_dir(const std::string& name, int family);

  // --- documented rules ---
  // semantics.md: in a directory of rank shards a model name shows the consolidated file its
  // shards make.
  static bool has_shards(const Dir& d);
  // semantics.md ("What the tree shows"): in a directory of rank shards "any real
  // model*.safetensors" is hidden. That includes a file still being written under a model name
  // (its backing file is a real file there): it is not listed and not found by name until it
  // commits; its writer reads it through its handle.
  static bool hidden(const Dir& d, const std::string& name, const Entry& e);
  // semantics.md: "In a directory that is no checkpoint yet and shows plain files under other
  // model names, a consolidated file is stored whole (splitting it would hide them)".
  static bool plain_model_other(const Dir& d, const std::string& name,
                                const std::string& except = "");
  // An orphan whose old name holds something else now (a stored file, other files' shards): its
  // FLUSH is judged by nothing but itself, and answers 0 as POSIX's close() does (issue 21 found
  // EINVAL here; fixed in issue 34).
  static bool orphan_over_stored(const Handle& h);

  // --- ops ---
  // What `op` must answer, asked through the kernel (a real mount) or directly. Reads SRC where
  // the answer depends on what the view hides (.ckptfs), so it is called before the op is
  // applied.
  Expect expect(const Op& op, bool kernel);
  // The op succeeded (as expected): the tree after it.
  Effect apply(const Op& op);

  void hit(const std::string& c) { ++cov_[c]; }

 private:
  void orphan(Handle& h);
  void orphan_entries_of(Entry& e);
  void forget_dir(const Dir* d);         // a directory leaves the model: no handle points at it
  bool writer_from(const Dir* d) const;  // a file created in d is still being written
  Effect apply_close(const Op& op);
  Effect apply_rename(const Op& op);
  Expect expect_rename(const Op& op, bool kernel);
  Expect expect_rename_dir(const Op& op);

  std::string src_;
  Counters& cov_;
};

}  // namespace ckptfs::fsmodel

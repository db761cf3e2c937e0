// fs_model/harness: the Driver interface (how ops reach a filesystem) and the Runner that applies
// each generated op to a Driver, judges its answer by the model and checks the whole tree.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/util/result.hpp"
#include "generator.hpp"
#include "model.hpp"

namespace ckptfs::fsmodel {

// An answer: success (err 0) or an errno, with the driver's words for it.
struct Answer {
  int err = 0;
  std::string msg;
  static Answer of_errno(int e, std::string what) { return {e, std::move(what)}; }
};

struct FileStat {
  Answer ans;
  bool is_dir = false, is_reg = false;
  uint64_t size = 0;
};

// Reads at (offset, length): each may come back short at the end of the file.
using ReadParts = std::vector<std::pair<uint64_t, uint64_t>>;

// How a sequence's ops reach a filesystem. Names are (directory, name) with directories named
// at the root ("" the root itself); writers are the model's handle ids.
class Driver {
 public:
  virtual ~Driver() = default;
  // Starts on an empty tree; `ranks` is what the sequence drew. Returns the rank count written
  // files are split into (a mount has its own), or why it could not start.
  virtual Result<uint32_t> start(uint32_t ranks) = 0;
  // SRC: changed directly by the runner, and looked at for what is stored.
  [[nodiscard]] virtual const std::string& src() const = 0;
  // Whether the kernel sits between the ops and ckptfs (it answers some itself).
  [[nodiscard]] virtual bool through_kernel() const = 0;

  // open(dir/name, flags) of a new writer `handle`.
  virtual Answer create(const std::string& dir, const std::string& name, int flags, int handle) = 0;
  virtual Answer write(int handle, uint64_t off, std::string_view bytes, size_t& wrote) = 0;
  virtual Answer flush(int handle) = 0;  // a dup'd descriptor closed: the file stays open
  virtual Answer close(int handle) = 0;  // the writer is gone, whatever the answer
  virtual Answer fsync(int handle, bool datasync) = 0;
  virtual Answer rename(const std::string& dir, const std::string& name, const std::string& to_dir,
                        const std::string& to_name, unsigned flags) = 0;
  virtual Answer unlink(const std::string& dir, const std::string& name) = 0;
  virtual Answer mkdir(const std::string& name) = 0;  // at the root
  virtual Answer rmdir(const std::string& name) = 0;  // at the root

  // The names a directory lists (no . and ..), in any order.
  virtual Answer list(const std::string& dir, std::vector<std::string>& names) = 0;
  virtual FileStat stat(const std::string& dir, const std::string& name) = 0;
  // Opens dir/name read-only, reads `parts` and closes it.
  virtual Answer read_name(const std::string& dir, const std::string& name, const ReadParts& parts,
                           std::string& out) = 0;
  // Reads `parts` through the writer's own handle.
  virtual Answer read_handle(int handle, const ReadParts& parts, std::string& out) = 0;

  // Time passes: past settle, revalidate (and the kernel's caches).
  virtual void pass_time() = 0;
};

// One seeded sequence through a driver. After every step the tree is checked against the model:
// the names each directory lists, each file's type and size, its bytes read back through the
// writer's handle (a file open for writing) and through a fresh open by name; a name the model
// does not hold is not found. A failure says the seed, the step and the ops that led there.
class Runner {
 public:
  Runner(Driver& d, uint64_t seed, int ops, Counters& cov);
  // Runs the sequence; returns the first discrepancy, with what led to it.
  std::optional<std::string> go();

 private:
  std::string fail(const std::string& what) const;
  void note(std::string s);
  std::optional<std::string> run(const Op& op);
  std::optional<std::string> judge(const Op& op, const Expect& want, const Answer& got) const;
  std::optional<std::string> check_effect(const Effect& e);
  std::optional<std::string> check_src(const std::string& dname, const std::string& name);
  std::optional<std::string> change_src(const Op& op);

  std::optional<std::string> check();
  std::optional<std::string> check_file(const std::string& dname, const std::string& name,
                                        const Entry& e);
  std::optional<std::string> check_hidden(const std::string& dname, const std::string& name,
                                          const Entry& e);
  ReadParts split(uint64_t size);

  Driver& d_;
  const uint64_t seed_;
  const int ops_;
  std::mt19937_64 rng_;
  Counters& cov_;
  Model m_;
  Generator gen_;
  int step_ = 0;
  bool src_changed_ = false;
  std::vector<std::string> log_;
};

int env_int(const char* name, int dflt);

}  // namespace ckptfs::fsmodel

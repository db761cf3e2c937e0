// write/store_checks: whether a file closed or renamed under a model name may be stored as rank
// shards in its directory, decided on the parsed headers its writer holds (write::Prospect).
//
// In a checkpoint directory the view shows, under a model name, the consolidated file its
// shards make: a real file of that name is hidden. So a file that ends up whole under such a
// name (not a consolidated safetensors file, cut short, too large a header to split, no memory
// or staging for it) must not be reported stored when nobody could read it back. Tests:
// tests/unit/test_store_checks.cpp; through the mount, tests/python/test_write.py.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/file.hpp"

namespace ckptfs::write {

class StoreChecks {
 public:
  // Whether file (dev, ino) is open for writing through the mount now (the fs layer's registry).
  using BeingWritten = std::function<bool(uint64_t dev, uint64_t ino)>;
  // `headers`: the cache the views read shard headers through (must outlive this); `build`: the
  // options the views are built with, so a check builds what the view will.
  StoreChecks(source::HeaderCache& headers, layout::BuildOptions build, BeingWritten being_written);

  struct NameState {
    bool stored = false;  // the name has a stored form (its record and shards, or DCP shards)
    bool others = false;  // the directory holds rank shards or records of other files
    // The directory is a native checkpoint (torch DCP, accelerate's folder, verl): its view
    // owns every model name, and a file written under one would be hidden. Its format.
    std::string native;
  };
  // The format of the native checkpoint directory `dirfd` is (empty: none).
  static std::string native_format(int dirfd);
  // What model name `name` of directory `dirfd` (listed as `entries`) stores, and beside what.
  static NameState name_state(int dirfd, const std::vector<source::DirEntry>& entries,
                              std::string_view name);

  // Whether file `name` of `dirfd` is a consolidator's header, its data to come: a regular
  // file under a model name that holds a safetensors header and nothing after it. torch's
  // consolidation writes every output file's header first, closes it, and reopens it to
  // append: beside `sharded/` (enable_consolidation) and into any directory
  // (consolidate_safetensors_files).
  static bool consolidators_header(int dirfd, const std::string& name);

  // How a name stands once place_whole accepted the whole file its writer closed.
  enum class Placed {
    Shown,       // a plain file of a plain directory, shown as written
    AwaitsData,  // a consolidator's header, for its writer to reopen; the name shows nothing
    // The same over a name that stores a consolidated file: that version is its writer's to
    // drop, as its O_TRUNC drops it in a plain directory (the caller removes it).
    AwaitsDataOverStored,
  };
  // After a close left file `name` of directory `dirfd` whole for reason `why`: the name keeps
  // its stored consolidated file if it has one, and a directory of rank shards would hide it;
  // either way an error (close() fails with it), unless it is a consolidator's header (saved
  // again, for its writer to reopen). Otherwise it is a plain file of a plain directory, shown
  // as written. `display` names the directory in messages.
  [[nodiscard]] Result<Placed> place_whole(int dirfd, const std::string& display,
                                           const std::string& name, const Error& why) const;
  // Whether storing `name` as rank shards would hide plain files (see the .cpp).
  [[nodiscard]] bool split_hides_plain(int dirfd, std::string_view name) const;
  // Whether the directory's checkpoint stays valid with `name` stored as `p`: the builder the
  // view uses, on the directory's other shards and records plus `p`'s parsed headers. EINVAL
  // names the first problem.
  [[nodiscard]] Status validate(int dirfd, const std::string& display, std::string_view name,
                                const Prospect& p) const;
  // The rules a WriteFile stores `name` of `dirfd` by (write::StoreRules); `dirfd` must stay
  // open while they are used.
  [[nodiscard]] StoreRules rules(int dirfd, const std::string& display,
                                 std::string_view name) const;

 private:
  source::HeaderCache& headers_;
  layout::BuildOptions build_;
  BeingWritten being_written_;
};

}  // namespace ckptfs::write

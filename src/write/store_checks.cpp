// write/store_checks: whether a file under a model name may be stored as rank shards, decided on
// the parsed headers its writer holds (include/ckptfs/write/store_checks.hpp).
#include "ckptfs/write/store_checks.hpp"

#include <sys/stat.h>

#include <optional>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/distcp.hpp"
#include "ckptfs/source/verl.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/dedup.hpp"

namespace ckptfs::write {

namespace {

// Whether file `name` of `dirfd` (inode `ino`, where given) holds a safetensors header and
// nothing after it, and is not whole that way: its data is still to come. A header of no
// tensors, or of empty ones only, is a complete file (a consolidated file of no data), never
// a consolidator's first step.
bool header_alone(int dirfd, const std::string& name, std::optional<uint64_t> ino = {}) {
  struct stat st {};
  auto fd = open_regular_at(dirfd, name, name, &st);
  if (!fd || (ino && st.st_ino != *ino)) return false;
  const auto size = static_cast<uint64_t>(st.st_size);
  auto n = format::read_header_length(fd->get(), size, name);
  if (!n || size != format::kHeaderLenBytes + *n || *n <= 2) return false;
  auto prefix = format::read_header_prefix(fd->get(), *n, name);
  return prefix && !format::parse_header_json(
                       std::string_view(*prefix).substr(format::kHeaderLenBytes), size, name);
}

}  // namespace

bool StoreChecks::consolidators_header(int dirfd, const std::string& name) {
  return format::parse_model_name(name) && header_alone(dirfd, name);
}

StoreChecks::StoreChecks(source::HeaderCache& headers, layout::BuildOptions build,
                         BeingWritten being_written)
    : headers_(headers), build_(std::move(build)), being_written_(std::move(being_written)) {}

auto StoreChecks::name_state(int dirfd, const std::vector<source::DirEntry>& entries,
                             std::string_view name) -> NameState {
  NameState ns;
  const auto mn = format::parse_model_name(name);
  if (!mn) return ns;
  ns.native = native_format(dirfd);
  if (!ns.native.empty()) {
    ns.others = true;
    return ns;
  }
  bool mine_recorded = false, other_same_km = false;
  for (const auto& [rel, st] : source::record_files(dirfd, entries)) {
    const std::string_view file = format::parse_record_name(rel).value_or("");
    if (file == name) {
      mine_recorded = true;
      continue;
    }
    ns.others = true;
    if (auto om = format::parse_model_name(file); om && om->k == mn->k && om->m == mn->m) {
      other_same_km = true;
    }
  }
  // Shards of (k, m) are this name's when its record names them, or when the name is the
  // one the view synthesizes for them and no record gives them another name.
  const bool km_mine = mine_recorded || (!mn->single && !other_same_km);
  for (const auto& e : entries) {
    auto p = format::parse_shard_name(e.name);
    if (!p) continue;
    if (p->k == mn->k && p->m == mn->m && km_mine) {
      ns.stored = true;
    } else {
      ns.others = true;
    }
  }
  ns.stored = ns.stored || mine_recorded;
  return ns;
}

std::string StoreChecks::native_format(int dirfd) {
  auto entries = source::list_checkpoint_dir(dirfd);
  if (!entries) return {};
  if (source::is_distcp_dir(*entries)) return "torch DCP";
  if (source::is_accelerate_dir(*entries)) return "accelerate FSDP (torch DCP)";
  if (source::is_verl_dir(*entries)) return "verl FSDP";
  return {};
}

// After a close left file `name` of directory `dirfd` whole for reason `why`: the name keeps
// its stored consolidated file if it has one (a writer killed mid-save must not cost the
// version it was replacing), and a directory of rank shards would hide it; either way close()
// fails with `why`. A consolidator's header is the exception: kept for its writer, and the
// version the name stored is the caller's to drop (AwaitsDataOverStored), as its writer's
// O_TRUNC drops it in a plain directory. Otherwise it is a plain file of a plain directory,
// shown as written.
auto StoreChecks::place_whole(int dirfd, const std::string& display, const std::string& name,
                              const Error& why) const -> Result<Placed> {
  if (why.code == EIO) {
    // Cut short: kept as the bytes received (a consolidated file that ends early must never
    // read as complete), which is not what the writer made; close() says so.
    return Error{EIO, why.message + "; kept as the bytes received"};
  }
  auto entries = source::list_dir(dirfd);
  if (!entries) return std::move(entries).error().context(display);
  const NameState ns = name_state(dirfd, *entries, name);
  if (!ns.stored && !ns.others) return Placed::Shown;
  if (ns.native.empty() && why.code == EINVAL && consolidators_header(dirfd, name)) {
    // A consolidator saving again (torch's, beside `sharded/` or into any directory): its
    // header first, its data to come after a reopen (its writer's view resolves the name to
    // this file). Until it closes complete, the name shows nothing to anyone else
    // (fs/namespace), never the file it replaces beside the new ones.
    spdlog::info(
        "{}; kept for its writer to append to: the name shows nothing to anyone else "
        "until it is stored",
        why.message);
    return ns.stored ? Placed::AwaitsDataOverStored : Placed::AwaitsData;
  }
  const std::string msg = fmt::format(
      "{}; not stored: {}", why.message,
      !ns.native.empty()
          ? fmt::format("in a {} checkpoint directory every model name shows the consolidated "
                        "view of its native files, and this one would be hidden (write it in "
                        "another directory, or under another name)",
                        ns.native)
      : ns.stored ? "the name keeps the consolidated file stored under it (write a complete "
                    "consolidated safetensors file, or rename a file over it)"
                  : "in a directory of rank shards a model name shows a consolidated file, and "
                    "this one would be hidden");
  spdlog::warn("{}", msg);
  return Error{why.code ? why.code : EINVAL, msg};
}

// Whether storing file `name` of directory `dirfd` as rank shards would hide plain files: the
// directory is no checkpoint yet, and regular files under other model names (not being
// written through the mount) are shown there now. Such a file is stored whole instead.
//
// One kind of plain file does not count: beside a consolidator's rank shards (`sharded/`), a
// file holding a safetensors header and nothing after it. torch's consolidation into several
// files writes every file's header first, closes it, and then reopens each to append its
// data; each is stored when it closes complete (its writer keeps the directory's view as
// written meanwhile, so it reopens the others), and the file stays whole until then.
bool StoreChecks::split_hides_plain(int dirfd, std::string_view name) const {
  auto entries = source::list_dir(dirfd);
  if (!entries || source::is_checkpoint_dir(dirfd, *entries)) return false;
  const bool consolidating = origin_of(dirfd, "") == Origin::Below;
  for (const auto& e : *entries) {
    if (!S_ISREG(e.st.st_mode) || e.name == name || !format::parse_model_name(e.name)) continue;
    if (being_written_(static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino))) {
      continue;
    }
    if (!consolidating || !header_alone(dirfd, e.name, e.st.st_ino)) return true;
  }
  return false;
}

// Whether the directory's checkpoint stays valid with file `name` stored as the rank shards of
// `p`, in place of what the name (its file number) stores now: the same builder the view
// uses, on the directory's other shards and records plus these. EINVAL names the first
// problem (another file count, a tensor already in another file, no tensor at all, ...).
Status StoreChecks::validate(int dirfd, const std::string& display, std::string_view name,
                             const Prospect& p) const {
  const auto mn = format::parse_model_name(name);
  if (!mn) return make_error(EINVAL, "{}: not a model name", name);
  CKPTFS_TRY(auto entries, source::list_dir(dirfd));
  std::erase_if(entries, [&](const source::DirEntry& e) {
    auto sh = format::parse_shard_name(e.name);
    return sh && sh->k == mn->k && sh->m == mn->m;  // what the commit replaces
  });
  auto in = source::read_input(dirfd, entries, display, headers_, build_);
  // ...and what the records of that file number name (node-local shards are no entries).
  std::erase_if(in.shards, [&](const layout::ShardInput& si) {
    auto sh = format::parse_shard_name(si.name);
    return sh && sh->k == mn->k && sh->m == mn->m;
  });
  std::erase_if(in.overrides, [&](const layout::OutputOverride& o) {
    auto om = format::parse_model_name(o.name);
    return om && om->k == mn->k && om->m == mn->m;
  });
  // The writer's own parses: the plan made them with the bytes (layout::ShardLayout).
  for (uint32_t r = 0; r < p.shards.size(); ++r) {
    layout::ShardInput si;
    si.name = format::shard_file_name(r + 1, mn->k, mn->m);
    si.header = p.shards[r];
    in.shards.push_back(std::move(si));
  }
  layout::OutputOverride o;
  o.k = mn->k;
  o.name = std::string(name);
  o.header = std::string(p.header);
  o.parsed = p.parsed;
  o.record = o.name;
  in.overrides.push_back(std::move(o));
  auto ck = layout::build_checkpoint(std::move(in), build_);
  if (!ck->valid()) {
    return make_error(EINVAL, "{}/{}: the directory's checkpoint would be invalid with it: {}",
                      display, name, ck->problems.front().to_string());
  }
  if (ck->find_output(name) == nullptr) {  // a file of no tensors has no shard to show it
    return make_error(EINVAL, "{}/{}: it holds no tensor, so no rank shard would show it", display,
                      name);
  }
  return {};
}

StoreRules StoreChecks::rules(int dirfd, const std::string& display, std::string_view name) const {
  StoreRules r;
  if (!format::parse_model_name(name)) return r;
  if (auto native = native_format(dirfd); !native.empty()) {
    // Never split into rank shards beside native files (the directory would change format):
    // kept whole, and close() reports it hidden (place_whole).
    r.whole = Error{EINVAL, fmt::format("{}/{}", display, name)};
    return r;
  }
  if (split_hides_plain(dirfd, name)) {
    r.whole = Error{0, ""};
    return r;
  }
  r.validate = [this, dirfd, display](std::string_view n, const Prospect& p) {
    return validate(dirfd, display, n, p);
  };
  return r;
}

}  // namespace ckptfs::write

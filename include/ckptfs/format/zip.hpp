// The zip archives torch.save writes: where each stored member's bytes lie, checked exactly.
//
// A `torch.save` file (and each chunk DCP writes into a `.distcp`) is a zip archive whose
// members are all stored, not compressed: `<top>/data.pkl`, `<top>/data/<key>` (the tensors'
// raw bytes), `<top>/version`, ... This reads the end-of-central-directory record (zip64
// included, for archives and members past 4 GiB), the central directory and each member's
// local header, and gives each member's name and byte range within the archive. The archive
// is untrusted: a compressed or encrypted member, a member out of range, two members that
// overlap (the zip-bomb shape), names repeated or past the caps refuse the whole archive,
// naming `what` and the member.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format::zip {

struct Member {
  std::string name;
  uint64_t offset = 0;  // of its bytes, from the archive's first byte
  uint64_t size = 0;
};

struct Limits {
  size_t max_members = 1 << 16;
  uint64_t max_directory_bytes = 64 << 20;  // the central directory, read whole
};

// Reads `out.size()` bytes of the archive at `offset` (from its first byte); fails short.
using ReadAt = std::function<Status(uint64_t offset, std::span<char> out)>;

// The members of the archive of `size` bytes that `read` reads, in central-directory order.
Result<std::vector<Member>> members(uint64_t size, const ReadAt& read, std::string_view what,
                                    const Limits& limits = {});

// A torch.save archive's members by role: every member lies under one top folder.
struct TorchArchive {
  std::string top;               // "archive", or the file's stem
  Member pickle;                 // <top>/data.pkl
  std::vector<Member> storages;  // <top>/data/<key>, sorted by key (name holds the key only)
  [[nodiscard]] const Member* storage(std::string_view key) const;
};

Result<TorchArchive> torch_archive(std::vector<Member> all, std::string_view what);

}  // namespace ckptfs::format::zip

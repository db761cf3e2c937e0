// Locating stored zip members (torch.save archives): EOCD, zip64, central directory, local headers.
#include "ckptfs/format/zip.hpp"

#include <algorithm>
#include <array>
#include <unordered_set>

#include <fmt/format.h>

#include "ckptfs/util/checked.hpp"

namespace ckptfs::format::zip {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50;
constexpr uint32_t kEnd64LocatorSig = 0x07064b50;
constexpr uint64_t kEndSize = 22, kEnd64LocatorSize = 20, kEnd64Size = 56;
constexpr uint64_t kCentralSize = 46, kLocalSize = 30;
constexpr uint64_t kMaxComment = 0xffff;

// Little-endian fields of a record held in memory; a read past its end is a caller's bug the
// callers rule out by checking sizes first, so this returns 0 there rather than trusting it.
struct Le {
  std::string_view b;
  [[nodiscard]] uint64_t u(size_t at, int n) const {
    if (at + static_cast<size_t>(n) > b.size()) return 0;
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k)
      v = (v << 8) | static_cast<uint8_t>(b[at + static_cast<size_t>(k)]);
    return v;
  }
  [[nodiscard]] uint16_t u16(size_t at) const { return static_cast<uint16_t>(u(at, 2)); }
  [[nodiscard]] uint32_t u32(size_t at) const { return static_cast<uint32_t>(u(at, 4)); }
  [[nodiscard]] uint64_t u64(size_t at) const { return u(at, 8); }
};

Result<std::string> read_bytes(const ReadAt& read, uint64_t offset, uint64_t n) {
  std::string out(n, '\0');
  CKPTFS_CHECK(read(offset, std::span<char>(out.data(), out.size())));
  return out;
}

// A fixed-size record (the zip64 locator and end record) into an array.
template <size_t N>
Status read_record(const ReadAt& read, uint64_t offset, std::array<char, N>& out) {
  out.fill('\0');
  return read(offset, std::span<char>(out.data(), N));
}

struct Directory {
  uint64_t entries = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
};

// The end-of-central-directory record, and the zip64 one where the first holds placeholders.
Result<Directory> directory(uint64_t size, const ReadAt& read, std::string_view what) {
  if (size < kEndSize)
    return make_error(EINVAL, "{}: {} bytes is too short for a zip archive", what, size);
  // Torch writes no archive comment, so the record is almost always the last 22 bytes: read
  // those first, and search the longest tail a comment allows only when they are not it.
  uint64_t tail_len = kEndSize;
  std::string tail;
  size_t at = std::string::npos;
  for (int pass = 0; pass < 2 && at == std::string::npos; ++pass) {
    if (pass == 1) {
      if (size == kEndSize) break;
      tail_len = std::min(size, kEndSize + kMaxComment);
    }
    CKPTFS_TRY(tail, read_bytes(read, size - tail_len, tail_len));
    // The record is the last signature whose comment ends exactly at the archive's end.
    for (size_t k = tail.size() - kEndSize + 1; k-- > 0;) {
      const Le le{std::string_view(tail).substr(k)};
      if (le.u32(0) == kEndSig && k + kEndSize + le.u16(20) == tail.size()) {
        at = k;
        break;
      }
    }
  }
  if (at == std::string::npos) {
    return make_error(EINVAL, "{}: no zip end-of-central-directory record", what);
  }
  const uint64_t end_at = size - tail_len + at;
  const Le e{std::string_view(tail).substr(at, kEndSize)};
  if (e.u16(4) != 0 || e.u16(6) != 0 || e.u16(8) != e.u16(10)) {
    return make_error(EINVAL, "{}: a multi-disk zip archive", what);
  }
  Directory d{e.u16(10), e.u32(16), e.u32(12)};
  if (d.entries == 0xffff || d.offset == 0xffffffff || d.size == 0xffffffff) {
    if (end_at < kEnd64LocatorSize) return make_error(EINVAL, "{}: zip64 locator missing", what);
    std::array<char, kEnd64LocatorSize> loc;
    CKPTFS_CHECK(read_record(read, end_at - kEnd64LocatorSize, loc));
    const Le l{std::string_view(loc.data(), loc.size())};
    if (l.u32(0) != kEnd64LocatorSig || l.u32(4) != 0 || l.u32(16) > 1) {
      return make_error(EINVAL, "{}: zip64 locator missing or multi-disk", what);
    }
    const uint64_t at64 = l.u64(8);
    if (at64 > end_at - kEnd64LocatorSize || end_at - kEnd64LocatorSize - at64 < kEnd64Size) {
      return make_error(EINVAL, "{}: zip64 end record at {} is out of range", what, at64);
    }
    std::array<char, kEnd64Size> rec;
    CKPTFS_CHECK(read_record(read, at64, rec));
    const Le r{std::string_view(rec.data(), rec.size())};
    if (r.u32(0) != kEnd64Sig || r.u32(16) != 0 || r.u32(20) != 0 || r.u64(24) != r.u64(32)) {
      return make_error(EINVAL, "{}: zip64 end record is bad or multi-disk", what);
    }
    d = Directory{r.u64(32), r.u64(48), r.u64(40)};
    auto dir_end = checked_add(d.offset, d.size);
    if (!dir_end || *dir_end > at64) {
      return make_error(EINVAL,
                        "{}: zip central directory ({} bytes at {}) runs past its end record", what,
                        d.size, d.offset);
    }
    return d;
  }
  auto dir_end = checked_add(d.offset, d.size);
  if (!dir_end || *dir_end > end_at) {
    return make_error(EINVAL, "{}: zip central directory ({} bytes at {}) runs past its end record",
                      what, d.size, d.offset);
  }
  return d;
}

// The zip64 extended-information extra field (id 1) of a central entry: the 64-bit values of
// the fields the entry holds as 0xffffffff, in the order usize, csize, local offset.
Status apply_zip64(std::string_view extra, uint64_t& usize, uint64_t& csize, uint64_t& local,
                   std::string_view what, std::string_view name) {
  const bool need_u = usize == 0xffffffff, need_c = csize == 0xffffffff,
             need_l = local == 0xffffffff;
  if (!need_u && !need_c && !need_l) return {};
  const Le x{extra};
  for (size_t at = 0; at + 4 <= extra.size();) {
    const uint16_t id = x.u16(at), len = x.u16(at + 2);
    if (at + 4 + len > extra.size()) break;
    if (id == 1) {
      size_t f = at + 4;
      const size_t end = at + 4 + len;
      for (uint64_t* field :
           {need_u ? &usize : nullptr, need_c ? &csize : nullptr, need_l ? &local : nullptr}) {
        if (field == nullptr) continue;
        if (f + 8 > end)
          return make_error(EINVAL, "{}: zip member '{}': zip64 field too short", what, name);
        *field = x.u64(f);
        f += 8;
      }
      return {};
    }
    at += 4 + len;
  }
  return make_error(EINVAL, "{}: zip member '{}': sizes past 4 GiB with no zip64 field", what,
                    name);
}

}  // namespace

Result<std::vector<Member>> members(uint64_t size, const ReadAt& read, std::string_view what,
                                    const Limits& limits) {
  CKPTFS_TRY(Directory d, directory(size, read, what));
  if (d.entries > limits.max_members) {
    return make_error(EINVAL, "{}: zip archive of {} members (at most {})", what, d.entries,
                      limits.max_members);
  }
  if (d.size > limits.max_directory_bytes) {
    return make_error(EINVAL, "{}: zip central directory of {} bytes (at most {})", what, d.size,
                      limits.max_directory_bytes);
  }
  CKPTFS_TRY(std::string dir, read_bytes(read, d.offset, d.size));
  const Le c{dir};
  std::vector<Member> out;
  out.reserve(static_cast<size_t>(d.entries));
  struct Span {
    uint64_t begin, end;
    size_t member;
  };
  std::vector<Span> spans;
  std::unordered_set<std::string_view> names;
  size_t at = 0;
  for (uint64_t k = 0; k < d.entries; ++k) {
    if (at + kCentralSize > dir.size() || c.u32(at) != kCentralSig) {
      return make_error(EINVAL, "{}: zip central directory entry {} is cut short or bad", what, k);
    }
    const uint16_t flags = c.u16(at + 8), method = c.u16(at + 10);
    uint64_t csize = c.u32(at + 20), usize = c.u32(at + 24);
    const size_t nlen = c.u16(at + 28), xlen = c.u16(at + 30), clen = c.u16(at + 32);
    uint64_t local = c.u32(at + 42);
    if (at + kCentralSize + nlen + xlen + clen > dir.size()) {
      return make_error(EINVAL, "{}: zip central directory entry {} runs past the directory", what,
                        k);
    }
    std::string name = dir.substr(at + kCentralSize, nlen);
    const std::string_view extra = std::string_view(dir).substr(at + kCentralSize + nlen, xlen);
    at += kCentralSize + nlen + xlen + clen;
    if (method != 0) {
      return make_error(
          EINVAL, "{}: zip member '{}' is compressed (method {}); only stored members are served",
          what, name, method);
    }
    if (flags & 0x41) return make_error(EINVAL, "{}: zip member '{}' is encrypted", what, name);
    CKPTFS_CHECK(apply_zip64(extra, usize, csize, local, what, name));
    if (csize != usize) {
      return make_error(EINVAL, "{}: zip member '{}' is stored with {} bytes for {}", what, name,
                        csize, usize);
    }
    if (local > d.offset || d.offset - local < kLocalSize) {
      return make_error(EINVAL, "{}: zip member '{}': local header at {} is out of range", what,
                        name, local);
    }
    // The local header and its name in one read (the name is as long as the central one's,
    // or the member is refused below).
    CKPTFS_TRY(std::string lh,
               read_bytes(read, local, std::min<uint64_t>(kLocalSize + nlen, d.offset - local)));
    const Le l{lh};
    if (l.u32(0) != kLocalSig || l.u16(8) != 0) {
      return make_error(EINVAL, "{}: zip member '{}': bad local header at {}", what, name, local);
    }
    const uint64_t lnlen = l.u16(26), lxlen = l.u16(28);
    if (lnlen != nlen || std::string_view(lh).substr(kLocalSize) != name) {
      return make_error(EINVAL, "{}: zip member '{}': its local header names another file", what,
                        name);
    }
    const uint64_t data = local + kLocalSize + lnlen + lxlen;  // no overflow: local < 2^64 - 2^17
    auto data_end = checked_add(data, usize);
    if (!data_end || *data_end > d.offset) {
      return make_error(EINVAL, "{}: zip member '{}' ({} bytes at {}) runs past the archive's data",
                        what, name, usize, data);
    }
    spans.push_back(Span{local, *data_end, out.size()});
    out.push_back(Member{std::move(name), data, usize});
  }
  for (const Member& m : out) {
    if (!names.insert(m.name).second) {
      return make_error(EINVAL, "{}: zip member '{}' appears twice", what, m.name);
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k) {
    if (spans[k].begin < spans[k - 1].end) {
      return make_error(EINVAL, "{}: zip members '{}' and '{}' overlap", what,
                        out[spans[k - 1].member].name, out[spans[k].member].name);
    }
  }
  return out;
}

const Member* TorchArchive::storage(std::string_view key) const {
  // storages is sorted by key (torch_archive): a verl rank file holds one per tensor.
  auto it = std::lower_bound(storages.begin(), storages.end(), key,
                             [](const Member& m, std::string_view k) { return m.name < k; });
  return it != storages.end() && it->name == key ? &*it : nullptr;
}

Result<TorchArchive> torch_archive(std::vector<Member> all, std::string_view what) {
  TorchArchive a;
  bool have_pickle = false;
  for (Member& m : all) {
    const size_t slash = m.name.find('/');
    if (slash == std::string::npos || slash == 0) {
      return make_error(EINVAL,
                        "{}: zip member '{}' is not under a top folder (not a torch.save archive)",
                        what, m.name);
    }
    std::string_view top = std::string_view(m.name).substr(0, slash);
    if (a.top.empty()) a.top = std::string(top);
    if (top != a.top) {
      return make_error(EINVAL, "{}: zip members under two top folders ('{}' and '{}')", what,
                        a.top, top);
    }
    std::string_view rest = std::string_view(m.name).substr(slash + 1);
    if (rest == "data.pkl") {
      a.pickle = std::move(m);
      have_pickle = true;
    } else if (rest.starts_with("data/") && rest.size() > 5 &&
               rest.find('/', 5) == std::string_view::npos) {
      Member s = std::move(m);
      s.name = std::string(rest.substr(5));
      a.storages.push_back(std::move(s));
    }
  }
  if (!have_pickle) return make_error(EINVAL, "{}: no data.pkl in the torch.save archive", what);
  std::sort(a.storages.begin(), a.storages.end(),
            [](const Member& x, const Member& y) { return x.name < y.name; });
  return a;
}

}  // namespace ckptfs::format::zip

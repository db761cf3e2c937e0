// flush/mpi_wire: the OpenMPI flusher's wire format (include/ckptfs/flush/mpi.hpp): encoding
// and decoding of commands and replies. No MPI here: always built, tested in
// tests/unit/test_mpi.cpp.
#include <algorithm>

#include "ckptfs/flush/mpi.hpp"

namespace ckptfs::flush::mpi {
namespace {

void put_u32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_u64(std::string& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(std::string_view b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}
uint64_t get_u64(std::string_view b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

// Command layout: magic u32 | op u8, 3 zero bytes | shard u32 | pad u32 | id u64 | tx u64 |
// offset u64 | length u64  (48 bytes).
// Reply layout:   magic u32 | err i32 | id u64 | payload size u64  (24 bytes).

}  // namespace

bool reads_bytes(Op op) { return op == Op::Read || op == Op::ReadPath; }

std::string encode_command(const Command& c, std::string_view payload) {
  std::string b(kCommandBytes + payload.size(), '\0');
  put_u32(b, 0, kMagic);
  b[4] = static_cast<char>(c.op);
  put_u32(b, 8, c.shard);
  put_u64(b, 16, c.id);
  put_u64(b, 24, c.tx);
  put_u64(b, 32, c.offset);
  put_u64(b, 40, reads_bytes(c.op) ? c.length : payload.size());
  std::copy(payload.begin(), payload.end(), b.begin() + kCommandBytes);
  return b;
}

Result<Command> decode_command(std::string_view b, std::string_view* payload) {
  if (b.size() < kCommandBytes) return make_error(EPROTO, "mpi command: {} bytes, short", b.size());
  if (get_u32(b, 0) != kMagic) return make_error(EPROTO, "mpi command: bad magic");
  if (b[5] != 0 || b[6] != 0 || b[7] != 0 || get_u32(b, 12) != 0) {
    return make_error(EPROTO, "mpi command: nonzero padding");
  }
  Command c;
  const auto op = static_cast<uint8_t>(b[4]);
  if (op < static_cast<uint8_t>(Op::Open) || op > static_cast<uint8_t>(Op::Sweep)) {
    return make_error(EPROTO, "mpi command: unknown op {}", op);
  }
  c.op = static_cast<Op>(op);
  c.shard = get_u32(b, 8);
  c.id = get_u64(b, 16);
  c.tx = get_u64(b, 24);
  c.offset = get_u64(b, 32);
  c.length = get_u64(b, 40);
  const uint64_t body = b.size() - kCommandBytes;
  if (c.op == Op::Read       ? body != 0
      : c.op == Op::ReadPath ? (body == 0 || body > kMaxPathBytes)
                             : body != c.length) {
    return make_error(EPROTO, "mpi command: payload of {} bytes, header says {}", body, c.length);
  }
  if (c.offset + body < c.offset || (reads_bytes(c.op) && c.offset + c.length < c.offset)) {
    return make_error(EPROTO, "mpi command: offset overflows");
  }
  if (payload) *payload = b.substr(kCommandBytes);
  return c;
}

std::string encode_reply(const Reply& r, std::string_view payload) {
  std::string b(kReplyBytes + payload.size(), '\0');
  put_u32(b, 0, kMagic);
  put_u32(b, 4, static_cast<uint32_t>(r.err));
  put_u64(b, 8, r.id);
  put_u64(b, 16, payload.size());
  std::copy(payload.begin(), payload.end(), b.begin() + kReplyBytes);
  return b;
}

Result<Reply> decode_reply(std::string_view b, std::string_view* payload) {
  if (b.size() < kReplyBytes) return make_error(EPROTO, "mpi reply: {} bytes, short", b.size());
  if (get_u32(b, 0) != kMagic) return make_error(EPROTO, "mpi reply: bad magic");
  Reply r;
  r.err = static_cast<int32_t>(get_u32(b, 4));
  r.id = get_u64(b, 8);
  if (r.err < 0) return make_error(EPROTO, "mpi reply: negative errno {}", r.err);
  if (get_u64(b, 16) != b.size() - kReplyBytes) {
    return make_error(EPROTO, "mpi reply: payload size disagrees with its header");
  }
  if (payload) *payload = b.substr(kReplyBytes);
  return r;
}

}  // namespace ckptfs::flush::mpi

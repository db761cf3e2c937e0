// The rank server's dispatch (flush/mpi_dispatch.cpp), without MPI: every command on a real
// ShardStore, the answers that go back (or not), and malformed, short, oversized and unknown
// commands, which must give a clear error and never a crash. The MPI loop around it is tested
// with a real mpirun in tests/python/test_mpi.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/flush/store.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using namespace ckptfs::flush;
using namespace ckptfs::flush::mpi;
namespace stdfs = std::filesystem;

namespace {

std::unique_ptr<ShardStore> store_in(const std::string& root) {
  auto s = ShardStore::open(root);
  EXPECT_TRUE(s.ok()) << s.error().message;
  return std::move(s).value();
}

Command cmd(Op op, uint64_t id, uint64_t tx = 1, uint32_t shard = 0, uint64_t offset = 0,
            uint64_t length = 0) {
  Command c;
  c.op = op;
  c.id = id;
  c.tx = tx;
  c.shard = shard;
  c.offset = offset;
  c.length = length;
  return c;
}

// The answer to a command that takes one, which must be a success; its payload.
std::string ok(const std::optional<Answer>& a, uint64_t id) {
  EXPECT_TRUE(a.has_value());
  if (!a) return {};
  EXPECT_EQ(a->reply.id, id);
  EXPECT_EQ(a->reply.err, 0) << a->payload;
  return a->payload;
}

// The answer to a command that takes one, which must be an error: its errno (the message is
// checked to say something).
int err(const std::optional<Answer>& a, uint64_t id) {
  EXPECT_TRUE(a.has_value());
  if (!a) return 0;
  EXPECT_EQ(a->reply.id, id);
  EXPECT_GT(a->reply.err, 0);
  EXPECT_FALSE(a->payload.empty());
  return a->reply.err;
}

std::string slurp(const std::string& path) {
  auto r = read_small_file(path, 1 << 20);
  EXPECT_TRUE(r.ok()) << r.error().message;
  return r ? *r : std::string();
}

std::string with_nul(std::string_view a, std::string_view b) {
  std::string s(a);
  s.push_back('\0');
  s.append(b);
  return s;
}

}  // namespace

TEST(MpiDispatch, SharedTargetOpenWriteReadSyncClose) {
  test::TempDir d;
  stdfs::create_directories(d.path() + "/ck/.ckptfs/tx-1");
  test::write_file(d.path() + "/ck/.ckptfs/tx-1/rank-00002", std::string(8, '\0'));
  auto s = store_in(d.path());
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Open, 1, 5, 1), "ck/.ckptfs/tx-1/rank-00002"), 1), "");
  // Writes take no reply, whatever their id.
  EXPECT_FALSE(dispatch(*s, cmd(Op::Write, 0, 5, 1, 0), "abcd").has_value());
  EXPECT_FALSE(dispatch(*s, cmd(Op::Write, 9, 5, 1, 4), "efgh").has_value());
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Read, 2, 5, 1, 2, 4), {}), 2), "cdef");
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Read, 3, 5, 1, 0, 0), {}), 3), "");
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sync, 4, 5), {}), 4), "");
  EXPECT_FALSE(dispatch(*s, cmd(Op::Close, 0, 5), {}).has_value());
  EXPECT_FALSE(dispatch(*s, cmd(Op::Close, 7, 5), {}).has_value());
  EXPECT_EQ(slurp(d.path() + "/ck/.ckptfs/tx-1/rank-00002"), "abcdefgh");
  // Forgotten: a read of it is an error answer, a write is dropped.
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Read, 5, 5, 1, 0, 4), {}), 5), EIO);
  EXPECT_FALSE(dispatch(*s, cmd(Op::Write, 0, 5, 1, 0), "zz").has_value());
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sync, 6, 5), {}), 6), "");  // nothing held: nothing to sync
}

TEST(MpiDispatch, NodeLocalCreateWriteSealReadPathDropSweep) {
  test::TempDir d;
  auto s = store_in(d.path());
  Command create = cmd(Op::Create, 1, 7, 2, /*offset = size*/ 10);
  EXPECT_EQ(ok(dispatch(*s, create, with_nul("run/ck", "nl-ab-1")), 1), "");
  ASSERT_TRUE(stdfs::exists(d.path() + "/run/ck/.ckptfs/nl-ab-1/rank-00003"));
  EXPECT_FALSE(dispatch(*s, cmd(Op::Write, 0, 7, 2, 0), "helloworld").has_value());
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sync, 2, 7), {}), 2), "");
  const std::string name = "shard-00003-model-00001-of-00001.safetensors";
  const std::string path = ok(dispatch(*s, cmd(Op::Seal, 3, 7, 2), name), 3);
  EXPECT_EQ(path, "run/ck/.ckptfs/nl-ab-1/" + name);
  EXPECT_FALSE(dispatch(*s, cmd(Op::Close, 0, 7), {}).has_value());
  // ReadPath: `tx` carries the size the record says.
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::ReadPath, 4, 10, 0, 5, 5), path), 4), "world");
  EXPECT_EQ(err(dispatch(*s, cmd(Op::ReadPath, 5, 11, 0, 0, 5), path), 5), ESTALE);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::ReadPath, 6, 10, 0, 8, 5), path), 6), EIO);  // past the end
  // A sweep keeps what the payload names ('\0'-separated) and removes the rest.
  stdfs::create_directories(d.path() + "/old/.ckptfs/nl-zz-9");
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sweep, 7), with_nul("nl-ab-1", "nl-other")), 7), "1");
  EXPECT_FALSE(stdfs::exists(d.path() + "/old/.ckptfs/nl-zz-9"));
  EXPECT_TRUE(stdfs::exists(d.path() + "/" + path));
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Drop, 8), "run/ck/.ckptfs/nl-ab-1"), 8), "");
  EXPECT_FALSE(stdfs::exists(d.path() + "/run"));
  // An empty keep list: nothing is left to sweep.
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sweep, 9), {}), 9), "0");
}

TEST(MpiDispatch, AbortRemovesWhatTheTransactionMade) {
  test::TempDir d;
  auto s = store_in(d.path());
  ok(dispatch(*s, cmd(Op::Create, 1, 3, 0, 4), with_nul("a", "nl-x-1")), 1);
  ok(dispatch(*s, cmd(Op::Create, 2, 3, 1, 4), with_nul("a", "nl-x-1")), 2);
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Abort, 3, 3), {}), 3), "");
  EXPECT_FALSE(stdfs::exists(d.path() + "/a/.ckptfs/nl-x-1"));
  // Aborting again, or a transaction never seen: still a plain acknowledgement.
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Abort, 4, 3), {}), 4), "");
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Abort, 5, 99), {}), 5), "");
}

TEST(MpiDispatch, ALatchedWriteErrorComesBackAtTheSync) {
  test::TempDir d;
  auto s = store_in(d.path());
  s->inject_enospc_after(2);
  ok(dispatch(*s, cmd(Op::Create, 1, 4, 0, 8), with_nul("", "nl-f-1")), 1);
  EXPECT_FALSE(dispatch(*s, cmd(Op::Write, 0, 4, 0, 0), "abcd").has_value());
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Sync, 2, 4), {}), 2), ENOSPC);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Read, 3, 4, 0, 0, 4), {}), 3), ENOSPC);
  EXPECT_EQ(
      err(dispatch(*s, cmd(Op::Seal, 4, 4, 0), "shard-00001-model-00001-of-00001.safetensors"), 4),
      ENOSPC);
}

TEST(MpiDispatch, MalformedPayloadsAreErrorAnswers) {
  test::TempDir outer;
  stdfs::create_directories(outer.path() + "/t");
  stdfs::create_directories(outer.path() + "/secret/.ckptfs/nl-x");
  test::write_file(outer.path() + "/secret/f", "secret");
  auto s = store_in(outer.path() + "/t");
  // Create: no '\0' between the directory and the transaction name.
  auto a = dispatch(*s, cmd(Op::Create, 1, 1, 0, 4), "run/ck");
  EXPECT_EQ(err(a, 1), EPROTO);
  EXPECT_NE(a->payload.find("no transaction name"), std::string::npos) << a->payload;
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 2, 1, 0, 4), {}), 2), EPROTO);  // empty
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 3, 1, 0, 4), with_nul("../secret", "nl-a")), 3),
            EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 4, 1, 0, 4), with_nul("/abs", "nl-a")), 4), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 5, 1, 0, 4), with_nul("d", "tx-a")), 5), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 6, 1, 0, 4), with_nul("d", "")), 6), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Create, 7, 1, 0, 4), with_nul("d", "nl-a/..")), 7), EINVAL);
  // Open: outside the target, the target itself, nothing there.
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Open, 10), "../secret/f"), 10), EINVAL);
  EXPECT_GT(err(dispatch(*s, cmd(Op::Open, 11), ""), 11), 0);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Open, 12), "missing"), 12), ENOENT);
  // Seal: of a shard not held; with a name that is not one plain component.
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Seal, 20, 1, 0), "shard"), 20), EIO);
  ok(dispatch(*s, cmd(Op::Create, 21, 2, 0, 4), with_nul("d", "nl-b-1")), 21);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Seal, 22, 2, 0), "../x"), 22), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Seal, 23, 2, 0), ""), 23), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Seal, 24, 2, 0), "a/b"), 24), EINVAL);
  // ReadPath and Drop: only plain relative paths below the target.
  EXPECT_EQ(err(dispatch(*s, cmd(Op::ReadPath, 30, 6, 0, 0, 6), "../secret/f"), 30), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::ReadPath, 31, 6, 0, 0, 6), ""), 31), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Drop, 32), "../secret/.ckptfs/nl-x"), 32), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Drop, 33), "d/notstate/nl-x"), 33), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Drop, 34), ""), 34), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Drop, 35), std::string("d/.ckptfs/nl-\0x", 15)), 35), EINVAL);
  EXPECT_TRUE(stdfs::exists(outer.path() + "/secret/.ckptfs/nl-x"));
  EXPECT_EQ(slurp(outer.path() + "/secret/f"), "secret");
  // A sweep payload of empty names only keeps nothing more; never an error.
  EXPECT_EQ(ok(dispatch(*s, cmd(Op::Sweep, 36), std::string("\0\0", 2)), 36), "0");
}

TEST(MpiDispatch, OversizedRequestsAreRefusedNotAllocated) {
  test::TempDir d;
  auto s = store_in(d.path());
  ok(dispatch(*s, cmd(Op::Create, 1, 1, 0, 16), with_nul("", "nl-o-1")), 1);
  auto a = dispatch(*s, cmd(Op::Read, 2, 1, 0, 0, kMaxReadBytes + 1), {});
  EXPECT_EQ(err(a, 2), EINVAL);
  EXPECT_NE(a->payload.find("over the limit"), std::string::npos) << a->payload;
  EXPECT_EQ(err(dispatch(*s, cmd(Op::Read, 3, 1, 0, 0, UINT64_MAX), {}), 3), EINVAL);
  EXPECT_EQ(err(dispatch(*s, cmd(Op::ReadPath, 4, 16, 0, 0, UINT64_MAX), "x"), 4), EINVAL);
  // A read past the shard's end, within the limit: an error, not garbage.
  EXPECT_GT(err(dispatch(*s, cmd(Op::Read, 5, 1, 0, 8, 16), {}), 5), 0);
  // Paths longer than any the head sends.
  const std::string long_path(2 * kMaxPathBytes, 'a');
  EXPECT_GT(err(dispatch(*s, cmd(Op::Open, 6), long_path), 6), 0);
  EXPECT_GT(err(dispatch(*s, cmd(Op::ReadPath, 7, 1, 0, 0, 1), long_path), 7), 0);
  EXPECT_GT(err(dispatch(*s, cmd(Op::Create, 8, 9, 0, 4), with_nul(long_path, "nl-o-2")), 8), 0);
  // A shard size no file can have.
  EXPECT_GT(err(dispatch(*s, cmd(Op::Create, 9, 9, 1, UINT64_MAX), with_nul("", "nl-o-3")), 9), 0);
}

TEST(MpiDispatch, UnknownCommandsAreAClearError) {
  test::TempDir d;
  auto s = store_in(d.path());
  for (uint8_t op : {uint8_t{0}, uint8_t{13}, uint8_t{99}, uint8_t{255}}) {
    auto a = dispatch(*s, cmd(static_cast<Op>(op), 42), "whatever");
    EXPECT_EQ(err(a, 42), EPROTO);
    EXPECT_NE(a->payload.find("unknown command " + std::to_string(op)), std::string::npos)
        << a->payload;
  }
  // ... and on the wire they never get as far as dispatch.
  std::string buf = encode_command(cmd(Op::Sync, 1), {});
  buf[4] = 13;
  auto c = decode_command(buf, nullptr);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, EPROTO);
}

TEST(MpiDispatch, NoAnswerWithoutAnIdOrForCommandsThatTakeNone) {
  test::TempDir d;
  auto s = store_in(d.path());
  // id 0: nobody waits, not even for an error.
  EXPECT_FALSE(dispatch(*s, cmd(Op::Open, 0), "../x").has_value());
  EXPECT_FALSE(dispatch(*s, cmd(Op::Create, 0), "no-nul").has_value());
  EXPECT_FALSE(dispatch(*s, cmd(static_cast<Op>(77), 0), {}).has_value());
  EXPECT_FALSE(dispatch(*s, cmd(Op::Shutdown, 5), {}).has_value());
  EXPECT_FALSE(dispatch(*s, cmd(Op::Close, 5), {}).has_value());
}

TEST(MpiDispatch, ARankWithoutATargetRefusesWithWhy) {
  const Error why = make_error(ENOENT, "node-local target /nowhere: cannot create it");
  for (uint8_t op = 1; op <= 12; ++op) {
    const auto o = static_cast<Op>(op);
    auto a = refuse(cmd(o, 3), why);
    if (o == Op::Write || o == Op::Close || o == Op::Shutdown) {
      EXPECT_FALSE(a.has_value()) << int(op);
      continue;
    }
    ASSERT_TRUE(a.has_value()) << int(op);
    EXPECT_EQ(a->reply.id, 3u);
    EXPECT_EQ(a->reply.err, ENOENT);
    EXPECT_EQ(a->payload, why.message);
  }
  EXPECT_FALSE(refuse(cmd(Op::Sync, 0), why).has_value());
  // An error without an errno goes back as EIO.
  EXPECT_EQ(refuse(cmd(Op::Sync, 1), make_error(0, "odd")).value().reply.err, EIO);
}

TEST(MpiDispatch, AnswersTravelAsReplies) {
  test::TempDir d;
  auto s = store_in(d.path());
  auto a = dispatch(*s, cmd(Op::Create, 11, 1, 0, 4), "no-nul");
  ASSERT_TRUE(a.has_value());
  const std::string wire = encode_reply(a->reply, a->payload);
  std::string_view payload;  // views `wire`
  auto r = decode_reply(wire, &payload);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->id, 11u);
  EXPECT_EQ(r->err, EPROTO);
  EXPECT_EQ(payload, a->payload);
}

// Commands decoded from random bytes (short, long, with random fields and payloads), each
// dispatched: errors come back as answers, nothing crashes, nothing is written outside the
// target.
TEST(MpiDispatch, RandomCommandsNeverCrashNorEscape) {
  test::TempDir outer;
  stdfs::create_directories(outer.path() + "/t");
  test::write_file(outer.path() + "/f", "outside");
  // Sweeps log each directory they remove: not here.
  const auto level = spdlog::get_level();
  spdlog::set_level(spdlog::level::warn);
  auto s = store_in(outer.path() + "/t");
  std::mt19937_64 rng(21);
  const std::vector<std::string> paths = {"",
                                          "a",
                                          "a/b",
                                          "../f",
                                          "/etc/passwd",
                                          "a//b",
                                          "a/./b",
                                          "a/.ckptfs/nl-r-1",
                                          "a/.ckptfs/nl-r-1/rank-00001",
                                          std::string("a\0nl-r-1", 8),
                                          std::string("\0nl-r-2", 7),
                                          std::string("x\0tx-1", 6),
                                          std::string(300, 'n'),
                                          "shard-00001-model-00001-of-00001.safetensors"};
  const std::vector<uint64_t> numbers = {
      0, 1, 4, 16, 4096, kMaxReadBytes, kMaxReadBytes + 1, uint64_t{1} << 40, UINT64_MAX};
  int decoded = 0, answered = 0;
  for (int i = 0; i < 5000; ++i) {
    const auto pick = [&](const auto& v) { return v[rng() % v.size()]; };
    Command c;
    c.op = static_cast<Op>(1 + rng() % 12);
    if (c.op == Op::Shutdown) c.op = Op::Sync;
    c.id = rng() % 4;
    c.tx = rng() % 3;
    c.shard = static_cast<uint32_t>(rng() % 3);
    c.offset = pick(numbers) % (rng() % 2 ? 64 : UINT64_MAX);
    c.length = pick(numbers);
    std::string payload = pick(paths);
    if (c.op == Op::Write) payload = std::string(rng() % 64, 'w');
    std::string buf = encode_command(c, payload);
    switch (rng() % 4) {  // damage it sometimes
      case 0:
        buf.resize(rng() % (buf.size() + 1));
        break;
      case 1:
        buf[rng() % buf.size()] = static_cast<char>(rng());
        break;
      default:
        break;
    }
    std::string_view body;
    auto got = decode_command(buf, &body);
    if (!got) {
      EXPECT_EQ(got.error().code, EPROTO);
      continue;
    }
    ++decoded;
    if (got->op == Op::Shutdown) continue;  // the loop leaves there
    // Reads within the limit stay small (the over-limit ones are refused before allocating).
    if (reads_bytes(got->op) && got->length <= kMaxReadBytes) got->length %= 4097;
    if (auto a = dispatch(*s, *got, body)) {
      ++answered;
      EXPECT_EQ(a->reply.id, got->id);
      EXPECT_GE(a->reply.err, 0);
      if (a->reply.err != 0) {
        EXPECT_FALSE(a->payload.empty());
      }
    }
  }
  EXPECT_GT(decoded, 1000);
  EXPECT_GT(answered, 500);
  // Nothing outside the target was made or changed.
  size_t entries = 0;
  for (const auto& e : stdfs::directory_iterator(outer.path())) {
    ++entries;
    EXPECT_TRUE(e.path().filename() == "t" || e.path().filename() == "f") << e.path();
  }
  EXPECT_EQ(entries, 2u);
  EXPECT_EQ(slurp(outer.path() + "/f"), "outside");
  spdlog::set_level(level);
}

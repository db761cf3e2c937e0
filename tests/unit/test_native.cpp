// Unit tests of the native-format parsers: the restricted unpickler, the zip locator and
// torch DCP's .metadata and tensor pickles, verl's rank files (real files torch wrote:
// tests/fuzz/seeds-torch).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/pickle.hpp"
#include "ckptfs/format/verl.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/source/distcp.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

#include <fmt/format.h>

namespace {

using namespace ckptfs;
using namespace ckptfs::format;
using namespace std::string_literals;

std::string seed(const std::string& name) {
  const char* dir = std::getenv("CKPTFS_TORCH_SEEDS");
  std::ifstream f(std::string(dir ? dir : "tests/fuzz/seeds-torch") + "/" + name, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  EXPECT_FALSE(s.str().empty()) << name << " (set CKPTFS_TORCH_SEEDS)";
  return s.str();
}

// pickle.dumps(..., protocol=4) of {'a': [1, 2, (3, 'x')], 'b': None, 'c': True, 'd': 1.5,
// 'e': b'xy', 'f': -5, 'g': 2**40, 'h': -(2**63)}, and the same at protocol 2 (whose bytes
// are _codecs.encode(...): a global).
constexpr std::string_view kMixed4{
    "\x80\x04\x95\x5c\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x61\x94\x5d\x94\x28\x4b"
    "\x01\x4b\x02\x4b\x03\x8c\x01\x78\x94\x86\x94\x65\x8c\x01\x62\x94\x4e\x8c\x01\x63\x94\x88"
    "\x8c\x01\x64\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x01\x65\x94\x43\x02\x78\x79\x94"
    "\x8c\x01\x66\x94\x4a\xfb\xff\xff\xff\x8c\x01\x67\x94\x8a\x06\x00\x00\x00\x00\x00\x01\x8c"
    "\x01\x68\x94\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x75\x2e",
    103};
constexpr std::string_view kMixed2{
    "\x80\x02\x7d\x71\x00\x28\x58\x01\x00\x00\x00\x61\x71\x01\x5d\x71\x02\x28\x4b\x01\x4b\x02"
    "\x4b\x03\x58\x01\x00\x00\x00\x78\x71\x03\x86\x71\x04\x65\x58\x01\x00\x00\x00\x62\x71\x05"
    "\x4e\x58\x01\x00\x00\x00\x63\x71\x06\x88\x58\x01\x00\x00\x00\x64\x71\x07\x47\x3f\xf8\x00"
    "\x00\x00\x00\x00\x00\x58\x01\x00\x00\x00\x65\x71\x08\x63\x5f\x63\x6f\x64\x65\x63\x73\x0a"
    "\x65\x6e\x63\x6f\x64\x65\x0a\x71\x09\x58\x02\x00\x00\x00\x78\x79\x71\x0a\x58\x06\x00\x00"
    "\x00\x6c\x61\x74\x69\x6e\x31\x71\x0b\x86\x71\x0c\x52\x71\x0d\x58\x01\x00\x00\x00\x66\x71"
    "\x0e\x4a\xfb\xff\xff\xff\x58\x01\x00\x00\x00\x67\x71\x0f\x8a\x06\x00\x00\x00\x00\x00\x01"
    "\x58\x01\x00\x00\x00\x68\x71\x10\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x75\x2e",
    174};
constexpr std::string_view kSystem{"\x80\x02\x63posix\nsystem\n\x71\x00\x2e", 19};  // os.system
constexpr std::string_view kBig{"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01\x2e", 14};
constexpr std::string_view kSelf{"\x80\x02\x5d\x71\x00\x68\x00\x61\x2e", 9};  // l = [l]

template <typename T>
std::string err(const Result<T>& r) {
  return r.ok() ? "" : r.error().message;
}

TEST(Pickle, ReadsEveryValueKindWithoutAGlobal) {
  auto p = pickle::parse(kMixed4, {}, "mixed");
  ASSERT_TRUE(p.ok()) << err(p);
  pickle::Walk w(*p, "mixed");
  auto pairs = w.pairs(p->root(), "root");
  ASSERT_TRUE(pairs.ok());
  ASSERT_EQ(pairs->size(), 16u);
  auto a = w.sequence(*w.field(*pairs, "a"), "a");
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ(*w.integer((*a)[1], "a[1]"), 2);
  auto t = w.sequence((*a)[2], "a[2]");
  EXPECT_EQ(*w.text((*t)[1], "x"), "x");
  EXPECT_EQ(p->at(*w.field(*pairs, "b")).kind, pickle::Kind::None);
  EXPECT_EQ(p->at(*w.field(*pairs, "c")).i, 1);
  EXPECT_EQ(p->at(*w.field(*pairs, "d")).as_double(), 1.5);
  EXPECT_EQ(p->text(p->at(*w.field(*pairs, "e"))), "xy");
  EXPECT_EQ(*w.integer(*w.field(*pairs, "f"), "f"), -5);
  EXPECT_EQ(*w.integer(*w.field(*pairs, "g"), "g"), int64_t{1} << 40);
  EXPECT_EQ(*w.integer(*w.field(*pairs, "h"), "h"), INT64_MIN);
  EXPECT_FALSE(w.non_negative(*w.field(*pairs, "f"), "f").ok());
  EXPECT_FALSE(w.field(*pairs, "zz").has_value());
}

TEST(Pickle, RefusesGlobalsNotListedNamingThem) {
  auto p = pickle::parse(kSystem, {}, "evil.pkl");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(err(p).find("evil.pkl"), std::string::npos) << err(p);
  EXPECT_NE(err(p).find("posix.system"), std::string::npos) << err(p);
  auto q = pickle::parse(kMixed2, {}, "p2");
  ASSERT_FALSE(q.ok());
  EXPECT_NE(err(q).find("_codecs.encode"), std::string::npos) << err(q);
  // Listed, it reads: the call is a node, nothing runs.
  const pickle::GlobalName codecs[] = {{"_codecs", "encode"}};
  auto r = pickle::parse(kMixed2, codecs, "p2");
  ASSERT_TRUE(r.ok()) << err(r);
  pickle::Walk w(*r, "p2");
  auto e = *w.field(*w.pairs(r->root(), "root"), "e");
  EXPECT_TRUE(w.call(e, "_codecs", "encode", "e").ok());
}

TEST(Pickle, RefusesOpcodesOutsideTheListAndBadStreams) {
  struct Case {
    std::string bytes;
    std::string says;
  };
  const Case cases[] = {
      {"\x80\x02I1\n."s, "not an opcode"},             // INT (text)
      {"\x80\x02(i__main__\nX\n."s, "not an opcode"},  // INST
      {"\x80\x02N"s, "without STOP"},
      {"\x80\x02h\x05."s, "never stored"},
      {"\x80\x02Nr\xff\xff\xff\xff."s, "memo index"},
      {"\x80\x09N."s, "protocol 9"},
      {"\x80\x02NN."s, "one value expected"},
      {"."s, "one value expected"},
      {"\x80\x02X\xff\xff\xff\x7f"s, "are left"},
      {"\x80\x02t."s, "no mark"},
      {"\x80\x02Na."s, "not enough values"},
      {"\x80\x02K\x01)R."s, "not a global"},
      {"\x80\x02}Nb."s, "sets the state"},
      {"\x80\x02]((e."s, "no container"},  // the list lies below another open MARK
  };
  for (const auto& c : cases) {
    auto p = pickle::parse(c.bytes, {}, "bad");
    ASSERT_FALSE(p.ok()) << c.says;
    EXPECT_NE(err(p).find(c.says), std::string::npos) << err(p);
  }
  auto big = pickle::parse(kBig, {}, "big");
  EXPECT_NE(err(big).find("64 bits"), std::string::npos) << err(big);
}

TEST(Pickle, CapsValuesMarksAndMemo) {
  std::string many("\x80\x02(", 3);
  for (int i = 0; i < 200; ++i) many += "K\x01";
  many += "l.";
  pickle::Limits small;
  small.max_values = 100;
  EXPECT_NE(err(pickle::parse(many, {}, "many", small)).find("more than 100"), std::string::npos);
  EXPECT_TRUE(pickle::parse(many, {}, "many").ok());
  std::string marks("\x80\x02", 2);
  marks += std::string(5000, '(');
  EXPECT_NE(err(pickle::parse(marks, {}, "marks")).find("marks"), std::string::npos);
  pickle::Limits tiny_memo;
  tiny_memo.max_memo = 4;
  std::string memo("\x80\x04N", 3);
  for (int i = 0; i < 8; ++i) memo += "\x94";
  memo += ".";
  EXPECT_NE(err(pickle::parse(memo, {}, "memo", tiny_memo)).find("memo"), std::string::npos);
  pickle::Limits tiny_input;
  tiny_input.max_bytes = 8;
  EXPECT_EQ(pickle::parse(many, {}, "many", tiny_input).error().code, EFBIG);
}

TEST(Pickle, TheMemoIsDenseAsCPythonWritesIt) {
  // torch memoizes 16 entries per DCP chunk: 2 Mi (a 130,000-chunk .metadata's) are read
  // (a cap of 1 Mi refused real checkpoints past ~65k chunks).
  std::string many("\x80\x04N", 3);
  many.append(size_t{2} << 20, '\x94');  // MEMOIZE
  many +=
      "j\xff\xff\x1f\x00"
      "0."s;  // LONG_BINGET of the last entry, POP it, STOP
  auto p = pickle::parse(many, {}, "memo");
  ASSERT_TRUE(p.ok()) << err(p);
  EXPECT_EQ(p->at(p->root()).kind, pickle::Kind::None);
  // An index past the next one (CPython numbers them in order) is refused; one already
  // stored may be stored again.
  auto ahead = pickle::parse("\x80\x02Nq\x00q\x02."s, {}, "ahead");
  EXPECT_NE(err(ahead).find("memo index 2 skips ahead (the next is 1)"), std::string::npos)
      << err(ahead);
  auto again = pickle::parse(
      "\x80\x02Nq\x00q\x00h\x00"
      "0."s,
      {}, "again");
  EXPECT_TRUE(again.ok()) << err(again);
}

TEST(Pickle, ACycleThroughTheMemoIsHeldNotFollowed) {
  auto p = pickle::parse(kSelf, {}, "self");
  ASSERT_TRUE(p.ok()) << err(p);
  const auto& l = p->at(p->root());
  ASSERT_EQ(l.items.size(), 1u);
  EXPECT_EQ(l.items[0], p->root());
}

TEST(Pickle, AStrThatIsNotUtf8IsRefusedWhereItIsRead) {
  // ['ok', 'b\xffd']: the unpickler holds both; Walk::text gives the first and refuses the
  // second (Python's own unpickler cannot make that str), naming the input and the place.
  const std::string bytes(
      "\x80\x04]\x94(\x8c\x02ok\x8c\x03"
      "b\xff"
      "de.",
      16);
  auto p = pickle::parse(bytes, {}, "x.pkl");
  ASSERT_TRUE(p.ok()) << err(p);
  pickle::Walk w(*p, "x.pkl");
  auto items = w.sequence(p->root(), "root");
  ASSERT_TRUE(items.ok());
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ(*w.text((*items)[0], "items[0]"), "ok");
  auto bad = w.text((*items)[1], "items[1]");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(err(bad).find("x.pkl: items[1] is a str that is not valid UTF-8"), std::string::npos)
      << err(bad);
  EXPECT_NE(err(bad).find("b\\xffd"), std::string::npos) << err(bad);  // shown escaped
  // Overlong, surrogate and cut sequences too.
  for (std::string s : {"\xc0\xaf"s, "\xed\xa0\x80"s, "\xe2\x82"s}) {
    std::string b = "\x80\x04\x8c"s + static_cast<char>(s.size()) + s + ".";
    auto q = pickle::parse(b, {}, "y");
    ASSERT_TRUE(q.ok()) << err(q);
    EXPECT_FALSE(pickle::Walk(*q, "y").text(q->root(), "root").ok()) << b;
  }
}

// A DUP bomb: DUP pushes one reference per input byte and APPENDS keeps them all in the list.
std::string dup_bomb(size_t dups, size_t batch) {
  std::string b("\x80\x04]", 3);
  for (size_t done = 0; done < dups; done += batch) {
    b += "(N";
    b.append(std::min(batch, dups - done), '2');
    b += 'e';
  }
  b += '.';
  return b;
}

TEST(Pickle, CapsTheReferencesContainersHoldAndKeepsOneCopyOfTheInput) {
  pickle::Limits small;
  small.max_refs = 1000;
  // Under the cap: every reference is counted (the list holds 2 per batch: N and its DUP).
  auto ok = pickle::parse(dup_bomb(400, 100), {}, "ok", small);
  ASSERT_TRUE(ok.ok()) << err(ok);
  EXPECT_EQ(ok->refs(), 400u + 4);
  // Past it, in many APPENDS of few references each (no stack is ever large): refused, the
  // cap named.
  auto bomb = pickle::parse(dup_bomb(2000, 100), {}, "bomb.metadata", small);
  ASSERT_FALSE(bomb.ok());
  EXPECT_NE(err(bomb).find("bomb.metadata"), std::string::npos) << err(bomb);
  EXPECT_NE(err(bomb).find("more than 1000 references"), std::string::npos) << err(bomb);
  EXPECT_NE(err(bomb).find("max_refs"), std::string::npos) << err(bomb);
  // With the default caps: 20 Mi DUPs (20 MiB of input) would hold 80 MiB of references.
  auto big = pickle::parse(dup_bomb(size_t{20} << 20, 4096), {}, "big");
  ASSERT_FALSE(big.ok());
  EXPECT_NE(err(big).find("max_refs"), std::string::npos) << err(big);
  // The input is held once: the Pickle's text is the caller's buffer, moved in.
  std::string in = "\x80\x04\x8c\x40"s + std::string(64, 'k') + ".";
  const char* at = in.data();
  auto p = pickle::parse(std::move(in), {}, "moved");
  ASSERT_TRUE(p.ok()) << err(p);
  EXPECT_EQ(p->input().data(), at);
  EXPECT_EQ(p->text(p->at(p->root())).data(), at + 4);
}

TEST(Pickle, EveryPrefixAndByteFlipOfARealMetadataFailsCleanly) {
  const std::string meta = seed("small.metadata");
  for (size_t n = 0; n < meta.size(); ++n) {
    EXPECT_FALSE(parse_distcp_metadata(meta.substr(0, n), "cut").ok()) << n;
  }
  // Flips: whatever happens, no crash and no exception (ASan and UBSan check the rest).
  for (size_t at = 0; at < meta.size(); at += 7) {
    for (int v : {0x00, 0x28, 0x2e, 0x4a, 0x68, 0x72, 0x80, 0x8c, 0x94, 0xff}) {
      std::string m = meta;
      m[at] = static_cast<char>(v);
      (void)parse_distcp_metadata(std::move(m), "flip");
    }
  }
}

// ---- zip -------------------------------------------------------------------------------------

struct ZipEntry {
  std::string name;
  std::string data;
  uint16_t method = 0;
};

void le(std::string& s, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

// A stored zip archive, as torch's writer lays it out; zip64 puts every size and offset in
// zip64 extra fields and end records, as an archive past 4 GiB has them.
std::string build_zip(const std::vector<ZipEntry>& entries, bool zip64 = false,
                      std::string_view comment = {}) {
  std::string out, dir;
  for (const auto& e : entries) {
    const uint64_t local = out.size();
    std::string lx;
    if (zip64) {
      le(lx, 1, 2), le(lx, 16, 2), le(lx, e.data.size(), 8), le(lx, e.data.size(), 8);
    }
    le(out, 0x04034b50, 4), le(out, zip64 ? 45 : 20, 2), le(out, 0, 2), le(out, e.method, 2);
    le(out, 0, 4), le(out, 0, 4);
    le(out, zip64 ? 0xffffffff : e.data.size(), 4), le(out, zip64 ? 0xffffffff : e.data.size(), 4);
    le(out, e.name.size(), 2), le(out, lx.size(), 2);
    out += e.name + lx + e.data;
    std::string cx;
    if (zip64) {
      le(cx, 1, 2), le(cx, 24, 2), le(cx, e.data.size(), 8), le(cx, e.data.size(), 8),
          le(cx, local, 8);
    }
    le(dir, 0x02014b50, 4), le(dir, 45, 2), le(dir, zip64 ? 45 : 20, 2), le(dir, 0, 2);
    le(dir, e.method, 2), le(dir, 0, 4), le(dir, 0, 4);
    le(dir, zip64 ? 0xffffffff : e.data.size(), 4), le(dir, zip64 ? 0xffffffff : e.data.size(), 4);
    le(dir, e.name.size(), 2), le(dir, cx.size(), 2), le(dir, 0, 2), le(dir, 0, 2), le(dir, 0, 2);
    le(dir, 0, 4), le(dir, zip64 ? 0xffffffff : local, 4);
    dir += e.name + cx;
  }
  const uint64_t dir_at = out.size();
  out += dir;
  if (zip64) {
    const uint64_t end64_at = out.size();
    le(out, 0x06064b50, 4), le(out, 44, 8), le(out, 45, 2), le(out, 45, 2), le(out, 0, 4);
    le(out, 0, 4), le(out, entries.size(), 8), le(out, entries.size(), 8), le(out, dir.size(), 8);
    le(out, dir_at, 8);
    le(out, 0x07064b50, 4), le(out, 0, 4), le(out, end64_at, 8), le(out, 1, 4);
  }
  le(out, 0x06054b50, 4), le(out, 0, 2), le(out, 0, 2);
  le(out, zip64 ? 0xffff : entries.size(), 2), le(out, zip64 ? 0xffff : entries.size(), 2);
  le(out, zip64 ? 0xffffffff : dir.size(), 4), le(out, zip64 ? 0xffffffff : dir_at, 4);
  le(out, comment.size(), 2);
  out += comment;
  return out;
}

Result<std::vector<zip::Member>> members_of(const std::string& z, zip::Limits limits = {}) {
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > z.size() || out.size() > z.size() - off) return make_error(EIO, "past the end");
    std::memcpy(out.data(), z.data() + off, out.size());
    return {};
  };
  return zip::members(z.size(), read, "test.zip", limits);
}

const std::vector<ZipEntry> kEntries = {
    {"a/data.pkl", "PICKLE"}, {"a/data/0", std::string(100, 'x')}, {"a/version", "3\n"}};

TEST(Zip, LocatesStoredMembersPlainAndZip64) {
  for (bool z64 : {false, true}) {
    for (std::string_view comment : {std::string_view{}, std::string_view{"a comment"}}) {
      const std::string z = build_zip(kEntries, z64, comment);
      auto m = members_of(z);
      ASSERT_TRUE(m.ok()) << err(m);
      ASSERT_EQ(m->size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ((*m)[i].name, kEntries[i].name);
        EXPECT_EQ(z.substr((*m)[i].offset, (*m)[i].size), kEntries[i].data) << z64;
      }
      auto a = zip::torch_archive(*m, "t");
      ASSERT_TRUE(a.ok()) << err(a);
      EXPECT_EQ(a->top, "a");
      ASSERT_NE(a->storage("0"), nullptr);
      EXPECT_EQ(a->storage("0")->size, 100u);
    }
  }
}

TEST(Zip, RefusesWhatCannotBeServedExactly) {
  auto says = [](const std::string& z, std::string_view what, zip::Limits l = {}) {
    auto m = members_of(z, l);
    ASSERT_FALSE(m.ok()) << what;
    EXPECT_NE(err(m).find(what), std::string::npos) << err(m);
    EXPECT_NE(err(m).find("test.zip"), std::string::npos) << err(m);
  };
  auto compressed = kEntries;
  compressed[1].method = 8;
  says(build_zip(compressed), "compressed");
  auto twice = kEntries;
  twice[2].name = twice[0].name;
  says(build_zip(twice), "appears twice");
  says(build_zip(kEntries), "members (at most 2)", zip::Limits{2, 64 << 20});
  says(build_zip(kEntries).substr(0, 200), "end-of-central-directory");

  // The first member's central sizes grown into the second: the zip-bomb shape.
  std::string z = build_zip(kEntries);
  const size_t cd = z.find("PK\x01\x02");
  std::string grown = z;
  for (size_t off : {cd + 20, cd + 24}) grown[off] = static_cast<char>(6 + 60);
  says(grown, "overlap");
  // A member said to run past the archive's data.
  std::string past = z;
  past[cd + 20] = past[cd + 24] = '\0';
  past[cd + 22] = past[cd + 26] = '\x10';
  says(past, "runs past");
  // A local header offset past the directory.
  std::string far = z;
  far[cd + 44] = '\x7f';
  says(far, "out of range");
  // A local header naming another file.
  std::string other = z;
  other[30] = 'b';
  says(other, "another file");
}

TEST(Zip, ARealTorchSaveArchive) {
  const std::string pt = seed("f32.pt");
  auto m = members_of(pt);
  ASSERT_TRUE(m.ok()) << err(m);
  auto a = zip::torch_archive(*m, "f32.pt");
  ASSERT_TRUE(a.ok()) << err(a);
  auto rec = parse_torch_tensor_pickle(pt.substr(a->pickle.offset, a->pickle.size), "f32.pt");
  ASSERT_TRUE(rec.ok()) << err(rec);
  EXPECT_EQ(rec->dtype, DType::F32);
  EXPECT_EQ(rec->size, (std::vector<uint64_t>{2, 3}));
  EXPECT_TRUE(rec->contiguous());
  const auto* s = a->storage(rec->storage_key);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->size, 24u);
  float v[6];
  std::memcpy(v, pt.data() + s->offset, sizeof v);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(v[i], static_cast<float>(i));  // torch.arange(6)
}

TEST(Distcp, TensorPicklesOfEveryForm) {
  struct Case {
    const char* file;
    DType dtype;
    std::vector<uint64_t> size;
    uint64_t storage_offset;
    uint64_t storage_numel;
    bool contiguous;
  };
  const Case cases[] = {
      {"fp8.pt", DType::F8_E4M3, {4, 3}, 0, 12, true},          // _rebuild_tensor_v3, untyped
      {"bf16-view.pt", DType::BF16, {2, 4}, 4, 12, true},       // a view into a larger storage
      {"f32-transposed.pt", DType::F32, {4, 3}, 0, 12, false},  // strides (1, 4)
  };
  for (const auto& c : cases) {
    const std::string pt = seed(c.file);
    auto m = members_of(pt);
    ASSERT_TRUE(m.ok()) << err(m);
    auto a = zip::torch_archive(*m, c.file);
    ASSERT_TRUE(a.ok()) << err(a);
    auto rec = parse_torch_tensor_pickle(pt.substr(a->pickle.offset, a->pickle.size), c.file);
    ASSERT_TRUE(rec.ok()) << c.file << ": " << err(rec);
    EXPECT_EQ(rec->dtype, c.dtype) << c.file;
    EXPECT_EQ(rec->size, c.size) << c.file;
    EXPECT_EQ(rec->storage_offset, c.storage_offset) << c.file;
    EXPECT_EQ(rec->storage_numel, c.storage_numel) << c.file;
    EXPECT_EQ(rec->contiguous(), c.contiguous) << c.file;
  }
}

TEST(Distcp, MetadataOfASmallSave) {
  // dcp.save({"model": {"embed.weight": f32 [8, 4], "norm.weight": bf16 [4]}, "step": 3})
  auto md = parse_distcp_metadata(seed("small.metadata"), ".metadata");
  ASSERT_TRUE(md.ok()) << err(md);
  ASSERT_EQ(md->tensors.size(), 2u);
  EXPECT_EQ(md->bytes_items, std::vector<std::string>{"step"});
  const auto& e = md->tensors[0];
  EXPECT_EQ(e.key, "model.embed.weight");
  EXPECT_EQ(e.path, (std::vector<std::string>{"model", "embed.weight"}));
  EXPECT_EQ(e.dtype, DType::F32);
  EXPECT_EQ(e.size, (std::vector<uint64_t>{8, 4}));
  ASSERT_EQ(e.chunks.size(), 1u);
  EXPECT_EQ(e.chunks[0].file, "__0_0.distcp");
  EXPECT_EQ(e.chunks[0].offset, 1261u);
  EXPECT_EQ(e.chunks[0].length, 1705u);
  EXPECT_EQ(md->tensors[1].dtype, DType::BF16);
}

TEST(Distcp, MetadataOfAnFsdp2SaveWithOptimizerState) {
  // 3 FSDP2 ranks, bf16 tiny Llama, {"model": ..., "optimizer": ...} (dcp_fsdp_save.py --wrap).
  auto md = parse_distcp_metadata(seed("fsdp-wrapped.metadata"), ".metadata");
  ASSERT_TRUE(md.ok()) << err(md);
  size_t model = 0, optim = 0;
  for (const auto& t : md->tensors) {
    ASSERT_FALSE(t.path.empty()) << t.key;
    if (t.path[0] == "model") {
      ++model;
      ASSERT_EQ(t.chunks.size(), 3u) << t.key;  // one per rank: dim-0 blocks
      uint64_t rows = 0;
      std::set<std::string> files;
      for (const auto& c : t.chunks) {
        rows += c.sizes[0];
        files.insert(c.file);
      }
      EXPECT_EQ(rows, t.size[0]) << t.key;
      EXPECT_EQ(files, (std::set<std::string>{"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}));
    } else if (t.path[0] == "optimizer") {
      ++optim;
    }
  }
  EXPECT_EQ(model, 21u);
  EXPECT_EQ(optim, 60u);
}

// ---- .metadata made in the test -----------------------------------------------------------------

// What a tensor of a .metadata holds: its chunks and where each is stored.
struct MetaChunk {
  std::vector<uint64_t> offsets, sizes;
  std::string file;
  uint64_t offset = 0, length = 0;
};
struct MetaTensor {
  std::string key;
  std::vector<uint64_t> size;
  std::vector<MetaChunk> chunks;
  std::vector<std::string> path;  // planner_data (none when empty)
  std::string dtype = "float32";
};

// The pickle dcp.save's coordinator writes as .metadata (pickle.dump(Metadata), protocol 4),
// opcode for opcode in the shapes torch's objects take: NEWOBJ then BUILD of a state dict,
// torch.Size(tuple) by REDUCE, SETITEMS and APPENDS in batches of 1000 as Python's pickler
// writes them, globals and field names memoized and fetched again with LONG_BINGET.
class MetadataWriter {
 public:
  bool storage_reversed = false;  // storage_data in the reverse of the chunks' order

  std::string write(const std::vector<MetaTensor>& tensors) {
    out_.assign("\x80\x04", 2);
    object(kMetaMod, "Metadata");
    out_ += "}(";
    field("state_dict_metadata");
    dict(tensors.size(), [&](size_t i) {
      const MetaTensor& t = tensors[i];
      str(t.key);
      object(kMetaMod, "TensorStorageMetadata");
      out_ += "}(";
      field("properties");
      object(kMetaMod, "TensorProperties");
      out_ += '(';
      global("torch", t.dtype);
      out_ += "\x89\x89tb";  // (dtype, False, False): the fields after it are not read
      field("size");
      size(t.size);
      field("chunks");
      out_ += ']';
      batches(t.chunks.size(), 'e', [&](size_t c) {
        object(kMetaMod, "ChunkStorageMetadata");
        out_ += "}(";
        field("offsets");
        size(t.chunks[c].offsets);
        field("sizes");
        size(t.chunks[c].sizes);
        out_ += "ub";
      });
      out_ += "ub";
    });
    field("planner_data");
    std::vector<const MetaTensor*> with_path;
    for (const auto& t : tensors) {
      if (!t.path.empty()) with_path.push_back(&t);
    }
    dict(with_path.size(), [&](size_t i) {
      str(with_path[i]->key);
      out_ += '(';
      for (const auto& part : with_path[i]->path) str(part);
      out_ += 't';
    });
    field("storage_data");
    std::vector<std::pair<const MetaTensor*, const MetaChunk*>> all;
    for (const auto& t : tensors) {
      for (const auto& c : t.chunks) all.emplace_back(&t, &c);
    }
    if (storage_reversed) std::reverse(all.begin(), all.end());
    dict(all.size(), [&](size_t i) {
      const auto& [t, c] = all[i];
      object(kMetaMod, "MetadataIndex");
      out_ += "}(";
      field("fqn");
      str(t->key);
      field("offset");
      size(c->offsets);
      field("index");
      out_ += "Nub";
      object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
      out_ += "}(";
      field("relative_path");
      str(c->file);
      field("offset");
      integer(c->offset);
      field("length");
      integer(c->length);
      out_ += "ub";
    });
    out_ += "ub.";
    return out_;
  }

 private:
  static constexpr std::string_view kMetaMod = "torch.distributed.checkpoint.metadata";

  void put() {
    out_ += 'r';
    le(out_, memo_.size(), 4);
  }
  void get(uint32_t i) {
    out_ += 'j';
    le(out_, i, 4);
  }
  // A str; field names and globals' parts are memoized, as the pickler memoizes interned str.
  void str(std::string_view s, bool memoize = false) {
    if (memoize) {
      if (auto it = memo_.find(std::string(s)); it != memo_.end()) return get(it->second);
    }
    if (s.size() < 256) {
      out_ += '\x8c';
      out_ += static_cast<char>(s.size());
    } else {
      out_ += 'X';
      le(out_, s.size(), 4);
    }
    out_ += s;
    if (memoize) {
      const auto i = static_cast<uint32_t>(memo_.size());
      put();
      memo_.emplace(std::string(s), i);
    }
  }
  void field(std::string_view name) { str(name, true); }  // interned: memoized once
  void global(std::string_view module, std::string_view name) {
    const std::string key = std::string(module) + "\n" + std::string(name);
    if (auto it = memo_.find(key); it != memo_.end()) return get(it->second);
    str(module, true);
    str(name, true);
    out_ += '\x93';
    const auto i = static_cast<uint32_t>(memo_.size());
    put();
    memo_.emplace(key, i);
  }
  void object(std::string_view module, std::string_view name) {
    global(module, name);
    out_ += ")\x81";
  }
  void integer(uint64_t v) {
    if (v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v < (uint64_t{1} << 31)) {
      out_ += 'J';
      le(out_, v, 4);
    } else {
      out_ += "\x8a\x08";
      le(out_, v, 8);
    }
  }
  void size(const std::vector<uint64_t>& dims) {
    global("torch", "Size");
    out_ += '(';
    for (uint64_t d : dims) integer(d);
    out_ += "t\x85R";
  }
  // n items in batches of 1000, each batch MARK ... `op` (APPENDS or SETITEMS).
  template <typename F>
  void batches(size_t n, char op, F&& item) {
    for (size_t at = 0; at < n; at += 1000) {
      out_ += '(';
      for (size_t i = at; i < std::min(n, at + 1000); ++i) item(i);
      out_ += op;
    }
  }
  template <typename F>
  void dict(size_t n, F&& pair) {
    out_ += '}';
    batches(n, 'u', pair);
  }

  std::string out_;
  std::map<std::string, uint32_t> memo_;
};

std::string dcp_metadata(const std::vector<MetaTensor>& tensors) {
  return MetadataWriter().write(tensors);
}

// A tensor of `rows` x 3 float32 whose chunks are rows [2i, 2i + 2), each chunk in `file(i)` at
// `at(i)`, `length` bytes long (f32.pt's archive when the checkpoint is to be read).
MetaTensor rows_tensor(std::string key, size_t chunks,
                       const std::function<std::string(size_t)>& file,
                       const std::function<uint64_t(size_t)>& at, uint64_t length) {
  MetaTensor t;
  t.key = std::move(key);
  t.size = {2 * chunks, 3};
  for (size_t i = 0; i < chunks; ++i) {
    t.chunks.push_back(MetaChunk{{2 * i, 0}, {2, 3}, file(i), at(i), length});
  }
  return t;
}

TEST(Distcp, TheTestsMetadataWriterMakesWhatTheParserReads) {
  // The writer's pickle reads as torch's own does (MetadataOfASmallSave reads a real one).
  MetaTensor t{"model.w", {4, 3}, {}, {"model", "w"}};
  t.chunks = {{{0, 0}, {2, 3}, "__0_0.distcp", 0, 100}, {{2, 0}, {2, 3}, "__1_0.distcp", 7, 100}};
  auto md = parse_distcp_metadata(dcp_metadata({t}), ".metadata");
  ASSERT_TRUE(md.ok()) << err(md);
  ASSERT_EQ(md->tensors.size(), 1u);
  EXPECT_EQ(md->tensors[0].path, (std::vector<std::string>{"model", "w"}));
  EXPECT_EQ(md->tensors[0].chunks[1].file, "__1_0.distcp");
  EXPECT_EQ(md->tensors[0].chunks[1].offset, 7u);
  EXPECT_EQ(md->storage.size(), 2u);
}

TEST(Distcp, AKeyThatIsNotUtf8IsRefusedNamingTheFile) {
  // A real .metadata with its second key's bytes made invalid UTF-8 (same length, so the
  // pickle stays well formed): before, it reached the view and the JSON header threw.
  std::string meta = seed("small.metadata");
  const size_t at = meta.find("model.norm.weight");
  ASSERT_NE(at, std::string::npos);
  meta[at + 7] = '\xff';
  auto md = parse_distcp_metadata(std::move(meta), "ckpt/.metadata");
  ASSERT_FALSE(md.ok());
  EXPECT_NE(err(md).find("ckpt/.metadata"), std::string::npos) << err(md);
  EXPECT_NE(err(md).find("not valid UTF-8"), std::string::npos) << err(md);
  EXPECT_NE(err(md).find("model.n\\xffrm.weight"), std::string::npos) << err(md);
}

TEST(Distcp, AKeyNamedLikeTheHeadersOwnFieldIsRefused) {
  auto one = [](std::string key) {
    MetaTensor t{std::move(key), {2, 3}, {{{0, 0}, {2, 3}, "__0_0.distcp", 0, 10}}, {}};
    return parse_distcp_metadata(dcp_metadata({t}), "ckpt/.metadata");
  };
  for (std::string key : {"__metadata__"s, ""s}) {
    auto md = one(key);
    ASSERT_FALSE(md.ok()) << key;
    EXPECT_NE(err(md).find("ckpt/.metadata"), std::string::npos) << err(md);
  }
  EXPECT_NE(err(one("__metadata__")).find("'__metadata__'"), std::string::npos);
  EXPECT_TRUE(one("__metadata__.x").ok());  // a key below it is a name like any other
}

TEST(Distcp, SixtyThousandChunksParse) {
  // 60,000 chunks of one tensor (8 MB, as a 512-rank save of a large model has per few
  // tensors), stored in the reverse of their listed order: each storage entry finds its
  // chunk by its offsets. (Before: a walk of the tensor's chunks per entry, 1.8e9
  // comparisons.) How long it takes is measured in docs/benchmarks, not asserted here.
  const size_t n = 60'000;
  MetaTensor t = rows_tensor(
      "w", n, [](size_t i) { return fmt::format("__{}_0.distcp", i % 512); },
      [&](size_t i) { return (n - 1 - i) * 2000; }, 2000);
  MetadataWriter writer;
  writer.storage_reversed = true;
  std::string meta = writer.write({t});
  EXPECT_GT(meta.size(), 4'000'000u);
  auto md = parse_distcp_metadata(std::move(meta), ".metadata");
  ASSERT_TRUE(md.ok()) << err(md);
  ASSERT_EQ(md->tensors[0].chunks.size(), n);
  EXPECT_EQ(md->tensors[0].chunks[0].offset, (n - 1) * 2000);
  EXPECT_EQ(md->tensors[0].chunks[n - 1].offset, 0u);
  EXPECT_EQ(md->storage.front().offset, 0u);  // stored last-chunk first
  // Two chunks listed at the same offsets are refused (one of them could have no storage).
  t.chunks[1].offsets = t.chunks[0].offsets;
  auto twice = parse_distcp_metadata(dcp_metadata({t}), ".metadata");
  EXPECT_NE(err(twice).find("lists the chunk at [0, 0] twice"), std::string::npos) << err(twice);
}

TEST(Distcp, OverlappingStorageRangesInOneFileAreRefused) {
  // Every chunk's [offset, length) covering the same archive: each would cost a parse of all
  // of it. DCP writes each item's bytes once.
  auto same = [](size_t) { return uint64_t{100}; };
  auto file = [](size_t) { return "__0_0.distcp"s; };
  auto md = parse_distcp_metadata(dcp_metadata({rows_tensor("w", 300, file, same, 5000)}),
                                  "ckpt/.metadata");
  ASSERT_FALSE(md.ok());
  EXPECT_NE(err(md).find("ckpt/.metadata: storage of 'w' at bytes [100, 5100) and of 'w' at "
                         "[100, 5100) of __0_0.distcp overlap"),
            std::string::npos)
      << err(md);
  // Two tensors overlapping by one byte: both named.
  MetaTensor a = rows_tensor(
      "a", 1, file, [](size_t) { return 0; }, 1000);
  MetaTensor b = rows_tensor(
      "b", 1, file, [](size_t) { return 999; }, 1000);
  md = parse_distcp_metadata(dcp_metadata({a, b}), "m");
  EXPECT_NE(err(md).find("'a' at bytes [0, 1000) and of 'b' at [999, 1999)"), std::string::npos)
      << err(md);
  // Touching ranges, and the same range in two files, are what DCP writes.
  b.chunks[0].offset = 1000;
  EXPECT_TRUE(parse_distcp_metadata(dcp_metadata({a, b}), "m").ok());
  b.chunks[0].offset = 0;
  b.chunks[0].file = "__1_0.distcp";
  EXPECT_TRUE(parse_distcp_metadata(dcp_metadata({a, b}), "m").ok());
}

TEST(Distcp, MoreFilesThanTheCapAreRefused) {
  auto named = [](size_t files) {
    return dcp_metadata({rows_tensor(
        "w", files, [](size_t i) { return fmt::format("__{}_0.distcp", i); },
        [](size_t) { return 0; }, 10)});
  };
  EXPECT_TRUE(parse_distcp_metadata(named(kMaxDistcpFiles), ".metadata").ok());
  auto md = parse_distcp_metadata(named(kMaxDistcpFiles + 1), "ckpt/.metadata");
  ASSERT_FALSE(md.ok());
  EXPECT_NE(err(md).find("ckpt/.metadata: names more than 65536 files (kMaxDistcpFiles)"),
            std::string::npos)
      << err(md);
}

// ---- DCP directories read by the source layer (no mount) --------------------------------------

// A DCP checkpoint directory: `.distcp` files holding f32.pt (torch.save of a [2, 3] float32
// tensor) once per chunk, and a .metadata written last, as dcp.save leaves it.
class DcpDir {
 public:
  explicit DcpDir(const test::TempDir& t) : dir_(t.path()), archive_(seed("f32.pt")) {}

  // `chunks` chunks of a [2 * chunks, 3] tensor `key`, chunk i in `file(i)` at
  // `slot(i)` * the archive's length: every file written with the archives it holds.
  MetaTensor tensor(
      const std::string& key, size_t chunks, const std::function<std::string(size_t)>& file,
      const std::function<size_t(size_t)>& slot = [](size_t) { return 0; }) {
    const uint64_t len = archive_.size();
    MetaTensor t = rows_tensor(
        key, chunks, file, [&](size_t i) { return slot(i) * len; }, len);
    for (size_t i = 0; i < chunks; ++i) {
      std::string& bytes = files_[t.chunks[i].file];
      const size_t at = slot(i) * len;
      if (bytes.size() < at + len) bytes.resize(at + len);
      bytes.replace(at, len, archive_);
    }
    return t;
  }
  void write(const std::vector<MetaTensor>& tensors) {
    for (const auto& [name, bytes] : files_) test::write_file(dir_ + "/" + name, bytes);
    test::write_file(dir_ + "/.metadata", dcp_metadata(tensors));
  }
  [[nodiscard]] std::shared_ptr<const layout::Checkpoint> load() const {
    auto fd = open_file(dir_, O_RDONLY | O_DIRECTORY);
    EXPECT_TRUE(fd.ok());
    auto entries = source::list_checkpoint_dir(fd->get());
    EXPECT_TRUE(entries.ok());
    EXPECT_TRUE(source::is_checkpoint_dir(fd->get(), *entries));
    source::HeaderCache cache;
    return source::load_checkpoint(fd->get(), *entries, dir_, cache, {});
  }
  [[nodiscard]] const std::string& path() const { return dir_; }

 private:
  std::string dir_;
  std::string archive_;
  std::map<std::string, std::string> files_;
};

std::string problems(const layout::Checkpoint& ck) {
  std::string out;
  for (const auto& p : ck.problems) out += p.to_string() + "\n";
  return out;
}

void set_mtime(const std::string& path, int64_t sec, int64_t nsec = 0) {
  const struct timespec ts[2] = {{sec, nsec}, {sec, nsec}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), ts, 0), 0) << path;
}

TEST(DistcpSource, AServedNameBelowModelIsCheckedToo) {
  // {"model": {"__metadata__": t}}: the key 'model.__metadata__' is a fine key, but what
  // would be served is the header's own field.
  test::TempDir t;
  DcpDir d(t);
  MetaTensor w = d.tensor("model.w", 1, [](size_t) { return "__0_0.distcp"s; });
  w.path = {"model", "w"};
  MetaTensor m = d.tensor(
      "model.__metadata__", 1, [](size_t) { return "__0_0.distcp"s; }, [](size_t) { return 1; });
  m.path = {"model", "__metadata__"};
  d.write({w, m});
  auto ck = d.load();
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(problems(*ck).find(".metadata: tensor 'model.__metadata__': served below 'model': a "
                               "tensor named '__metadata__'"),
            std::string::npos)
      << problems(*ck);
  d.write({w});
  ck = d.load();
  EXPECT_TRUE(ck->valid()) << problems(*ck);
}

TEST(DistcpSource, AChunkArchiveOfManyMembersIsRefused) {
  // torch.save of one tensor has 7 members; an archive of 65,536 (a whole state dict's cap)
  // would be parsed whole for each chunk pointing at it.
  test::TempDir t;
  DcpDir d(t);
  MetaTensor w = d.tensor("w", 1, [](size_t) { return "__0_0.distcp"s; });
  d.write({w});
  ASSERT_TRUE(d.load()->valid()) << problems(*d.load());
  std::vector<ZipEntry> entries = {{"archive/data.pkl", "x"}, {"archive/data/0", "y"}};
  for (int i = 0; i < 100; ++i) entries.push_back({fmt::format("archive/m{}", i), ""});
  const std::string zip = build_zip(entries);
  w.chunks[0].length = zip.size();
  test::write_file(d.path() + "/__0_0.distcp", zip);
  test::write_file(d.path() + "/.metadata", dcp_metadata({w}));
  auto ck = d.load();
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(problems(*ck).find("__0_0.distcp: tensor 'w'"), std::string::npos) << problems(*ck);
  EXPECT_NE(problems(*ck).find("zip archive of 102 members (at most 64)"), std::string::npos)
      << problems(*ck);
}

TEST(DistcpSource, OnlyDcpDataFilesMayBeNamed) {
  // A .metadata naming a neighbour's torch.save file (same directory, a plain name) or itself.
  test::TempDir t;
  DcpDir d(t);
  MetaTensor w = d.tensor("w", 2, [](size_t i) { return fmt::format("__{}_0.distcp", i); });
  d.write({w});
  ASSERT_TRUE(d.load()->valid()) << problems(*d.load());
  for (const std::string name : {"secret.pt", ".metadata", ".distcp"}) {
    test::write_file(d.path() + "/" + name, seed("f32.pt"));
    MetaTensor bad = w;
    bad.chunks[1].file = name;
    test::write_file(d.path() + "/.metadata", dcp_metadata({bad}));
    auto ck = d.load();
    ASSERT_FALSE(ck->valid()) << name;
    EXPECT_NE(
        problems(*ck).find(fmt::format("names the file '{}', which is not a DCP data file", name)),
        std::string::npos)
        << problems(*ck);
  }
}

TEST(DistcpSource, ADataFileNewerThanMetadataIsASaveInProgress) {
  // dcp.save of v2 over v1, killed once its first .distcp was closed: that file is newer than
  // v1's .metadata (DCP writes .metadata last, and .distcp files in place).
  test::TempDir t;
  DcpDir d(t);
  MetaTensor w = d.tensor("w", 2, [](size_t i) { return fmt::format("__{}_0.distcp", i); });
  d.write({w});
  const std::string meta = d.path() + "/.metadata";
  set_mtime(d.path() + "/__0_0.distcp", 1'700'000'000);
  set_mtime(d.path() + "/__1_0.distcp", 1'700'000'000, 5);
  set_mtime(meta, 1'700'000'000, 5);  // the same time as the newest: fine
  ASSERT_TRUE(d.load()->valid()) << problems(*d.load());
  set_mtime(d.path() + "/__1_0.distcp", 1'700'000'000, 6);  // one nanosecond later
  auto ck = d.load();
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(problems(*ck).find("__1_0.distcp: written after .metadata"), std::string::npos)
      << problems(*ck);
  EXPECT_NE(problems(*ck).find("touch .metadata"), std::string::npos) << problems(*ck);
  EXPECT_EQ(problems(*ck).find("__0_0.distcp"), std::string::npos) << problems(*ck);
  set_mtime(meta, 1'700'000'001);  // .metadata written again, last: the save committed
  EXPECT_TRUE(d.load()->valid()) << problems(*d.load());
}

TEST(DistcpSource, ManyFilesAreReadOneDescriptorAtATime) {
  // 300 files, read with a descriptor limit of 64: one open at a time (before, one per file,
  // all held to the end: EMFILE here, and for the daemon's other users).
  test::TempDir t;
  DcpDir d(t);
  const size_t n = 300;
  MetaTensor w = d.tensor("w", n, [](size_t i) { return fmt::format("__{}_0.distcp", i); });
  d.write({w});
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  struct rlimit low = old;
  low.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  auto ck = d.load();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_TRUE(ck->valid()) << problems(*ck).substr(0, 2000);
  ASSERT_EQ(ck->tensors.size(), 1u);
  EXPECT_EQ(ck->tensors[0].chunks.size(), n);
  EXPECT_EQ(ck->tensors[0].shape, (std::vector<uint64_t>{2 * n, 3}));
}

// ---- verl (FSDP2 DTensor state dicts) ---------------------------------------------------------

TEST(Verl, RankFileNames) {
  auto n = parse_verl_rank_name("model_world_size_8_rank_7.pt");
  ASSERT_TRUE(n);
  EXPECT_EQ(n->kind, "model");
  EXPECT_EQ(n->world, 8u);
  EXPECT_EQ(n->rank, 7u);
  auto x = parse_verl_rank_name("extra_state_world_size_2_rank_0.pt");
  ASSERT_TRUE(x);
  EXPECT_EQ(x->kind, "extra_state");
  EXPECT_EQ(verl_rank_name("model", 8, 7), "model_world_size_8_rank_7.pt");
  for (const char* bad :
       {"model_world_size_2_rank_2.pt", "model_world_size_0_rank_0.pt",
        "model_world_size_02_rank_0.pt", "model_world_size_2_rank_0.bin", "_world_size_2_rank_0.pt",
        "model_world_size_2_rank_.pt", "model_world_size_99999999999_rank_0.pt",
        "model_world_size_2_rank_-1.pt"}) {
    EXPECT_FALSE(parse_verl_rank_name(bad)) << bad;
  }
  EXPECT_TRUE(is_verl_file_name("fsdp_config.json"));
  EXPECT_TRUE(is_verl_file_name("optim_world_size_2_rank_1.pt"));
  EXPECT_FALSE(is_verl_file_name("model.pt"));
}

TEST(Verl, Config) {
  auto c = parse_verl_config(R"({"FSDP_version": 2, "world_size": 4})", "fsdp_config.json");
  ASSERT_TRUE(c.ok()) << err(c);
  EXPECT_EQ(c->world_size, 4u);
  EXPECT_EQ(c->fsdp_version, 2);
  for (const char* bad :
       {R"({"FSDP_version": 2})", R"({"world_size": 0})", R"({"world_size": "2"})",
        R"({"world_size": 2, "world_size": 3})", R"([2])", R"({"world_size": -1})",
        R"({"world_size": 2, "FSDP_version": "x"})", "{"}) {
    auto r = parse_verl_config(bad, "fsdp_config.json");
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_NE(r.error().message.find("fsdp_config.json"), std::string::npos) << bad;
    }
  }
}

// torch.save(model.state_dict()) of nn.Sequential(Linear(4, 5), Linear(5, 3, bias=False)) under
// fully_shard on 3 gloo ranks: every value a DTensor, Shard(0), torch.chunk's rows (2, 2, 1).
std::string rank_pickle(const std::string& file) {
  const std::string pt = seed(file);
  auto m = members_of(pt);
  EXPECT_TRUE(m.ok()) << err(m);
  if (!m.ok()) return {};
  auto a = zip::torch_archive(*m, file);
  EXPECT_TRUE(a.ok()) << err(a);
  if (!a.ok()) return {};
  return pt.substr(a->pickle.offset, a->pickle.size);
}

TEST(Verl, ARealFsdp2RankStateDict) {
  struct Want {
    const char* key;
    std::vector<uint64_t> global, local0, local2;
  };
  const Want want[] = {{"0.weight", {5, 4}, {2, 4}, {1, 4}},
                       {"0.bias", {5}, {2}, {1}},
                       {"1.weight", {3, 5}, {1, 5}, {1, 5}}};
  for (uint64_t rank : {0u, 2u}) {
    const std::string file = fmt::format("fsdp2-rank{}of3.pt", rank);
    auto sd = parse_rank_state_dict(rank_pickle(file), file);
    ASSERT_TRUE(sd.ok()) << err(sd);
    ASSERT_EQ(sd->tensors.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      const auto& t = sd->tensors[i];
      EXPECT_EQ(t.key, want[i].key);
      EXPECT_TRUE(t.dtensor);
      EXPECT_EQ(t.dtype, DType::F32);
      EXPECT_EQ(t.global_size, want[i].global);
      EXPECT_EQ(t.local.size, rank == 0 ? want[i].local0 : want[i].local2) << t.key;
      ASSERT_EQ(t.placements.size(), 1u);
      EXPECT_EQ(t.placements[0].kind, Placement::Kind::Shard);
      EXPECT_EQ(t.placements[0].dim, 0u);
      EXPECT_EQ(t.coordinate, std::vector<uint64_t>{rank});
      EXPECT_TRUE(t.local.contiguous());
    }
  }
  // FSDP2 pads a short last shard's storage: the rows are the size, not the storage.
  auto sd = parse_rank_state_dict(rank_pickle("fsdp2-rank2of3.pt"), "r2");
  ASSERT_TRUE(sd.ok());
  EXPECT_EQ(sd->tensors[0].local.storage_numel, 8u);
}

TEST(Verl, EveryPrefixAndByteFlipOfARealRankFileFailsCleanly) {
  const std::string pkl = rank_pickle("fsdp2-rank2of3.pt");
  ASSERT_FALSE(pkl.empty());
  for (size_t n = 0; n < pkl.size(); ++n) {
    EXPECT_FALSE(parse_rank_state_dict(std::string_view(pkl).substr(0, n), "cut").ok()) << n;
  }
  for (size_t at = 0; at < pkl.size(); at += 5) {
    for (int v : {0x00, 0x28, 0x2e, 0x4b, 0x68, 0x71, 0x80, 0x85, 0x8a, 0xff}) {
      std::string m = pkl;
      m[at] = static_cast<char>(v);
      (void)parse_rank_state_dict(m, "flip");
    }
  }
}

TEST(Verl, RefusesGlobalsAndShapesItDoesNotServe) {
  const std::string pkl = rank_pickle("fsdp2-rank2of3.pt");
  auto swap = [&](std::string_view from, std::string_view to) {
    std::string m = pkl;
    const size_t at = m.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) m.replace(at, from.size(), to);
    return m;
  };
  // A global outside the list, by name (same length, so the stream stays well formed).
  auto r = parse_rank_state_dict(
      swap("torch.distributed.tensor\nDTensor", "subprocess\nPopenxxxxxxxxxxxxxxx"), "r2.pt");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("subprocess.Popenxxxxxxxxxxxxxxx"), std::string::npos) << err(r);
  EXPECT_NE(r.error().message.find("r2.pt"), std::string::npos);
  // Partial (a pending reduction) is not a placement it serves: not on the list either.
  r = parse_rank_state_dict(swap("placement_types\nShard\n", "placement_types\nPartial\n"),
                            "r2.pt");
  EXPECT_FALSE(r.ok());
}

// The source layer alone (no mount): three real FSDP2 rank files and fsdp_config.json tile
// each tensor by torch.chunk's rows; a rank missing or a world size that disagrees refuses it.
TEST(Verl, SourceTilesTheRanksAndRefusesAnIncompleteSave) {
  auto build = [](const std::string& dir) {
    auto fd = open_file(dir, O_RDONLY | O_DIRECTORY);
    EXPECT_TRUE(fd.ok());
    auto entries = source::list_checkpoint_dir(fd->get());
    EXPECT_TRUE(entries.ok());
    EXPECT_TRUE(source::is_checkpoint_dir(fd->get(), *entries));
    source::HeaderCache cache;
    return source::load_checkpoint(fd->get(), *entries, dir, cache, {});
  };
  test::TempDir t;
  for (int r = 0; r < 3; ++r) {
    test::write_file(t.path() + fmt::format("/model_world_size_3_rank_{}.pt", r),
                     seed(fmt::format("fsdp2-rank{}of3.pt", r)));
  }
  test::write_file(t.path() + "/fsdp_config.json", R"({"FSDP_version": 2, "world_size": 3})");
  auto ck = build(t.path());
  ASSERT_TRUE(ck->valid()) << (ck->problems.empty() ? "" : ck->problems[0].to_string());
  EXPECT_EQ(ck->format, "verl FSDP (model_world_size_W_rank_R.pt, fsdp_config.json)");
  ASSERT_EQ(ck->tensors.size(), 3u);
  const auto& w = ck->tensors[0];  // 0.weight [5, 4]: rows 2, 2, 1
  EXPECT_EQ(w.name, "0.weight");
  EXPECT_EQ(w.shape, (std::vector<uint64_t>{5, 4}));
  ASSERT_EQ(w.chunks.size(), 3u);
  std::vector<std::pair<uint64_t, uint64_t>> rows;
  for (const auto& c : w.chunks) rows.emplace_back(c.offsets[0], c.sizes[0]);
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(rows, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 2}, {2, 2}, {4, 1}}));

  // The config says 2 ranks: a rank file of world size 3 is refused by name.
  test::write_file(t.path() + "/fsdp_config.json", R"({"FSDP_version": 2, "world_size": 2})");
  ck = build(t.path());
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(ck->problems[0].to_string().find("model_world_size_3_rank_0.pt"), std::string::npos)
      << ck->problems[0].to_string();
  // A rank missing.
  test::write_file(t.path() + "/fsdp_config.json", R"({"FSDP_version": 2, "world_size": 3})");
  ASSERT_EQ(::unlink((t.path() + "/model_world_size_3_rank_1.pt").c_str()), 0);
  ck = build(t.path());
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(ck->problems[0].to_string().find("model_world_size_3_rank_1.pt: missing"),
            std::string::npos)
      << ck->problems[0].to_string();
}

}  // namespace

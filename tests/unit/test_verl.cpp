// verl's FSDP source against rank files a red team made (issue 32): ranks that are one file
// (hard links) are refused from the listing before any rank is read, the ranks are read one at
// a time against rank 0, and state-dict keys that cannot name a tensor are refused naming the
// file and the tensor. Real FSDP2 rank files torch wrote (tests/fuzz/seeds-torch), some edited.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "ckptfs/format/zip.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

namespace {

using namespace ckptfs;

std::string seed(const std::string& name) {
  const char* dir = std::getenv("CKPTFS_TORCH_SEEDS");
  std::ifstream f(std::string(dir ? dir : "tests/fuzz/seeds-torch") + "/" + name, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  EXPECT_FALSE(s.str().empty()) << name << " (set CKPTFS_TORCH_SEEDS)";
  return s.str();
}

// torch.save(model.state_dict()) of nn.Sequential(Linear(4, 5), Linear(5, 3, bias=False)) under
// fully_shard on 3 gloo ranks: keys 0.weight, 0.bias and 1.weight, every value a DTensor.
std::string rank_file(int r) { return seed(fmt::format("fsdp2-rank{}of3.pt", r)); }

std::string rank_name(int world, int r) {
  return fmt::format("model_world_size_{}_rank_{}.pt", world, r);
}

void write_config(const std::string& dir, int world) {
  test::write_file(dir + "/fsdp_config.json",
                   fmt::format(R"({{"FSDP_version": 2, "world_size": {}}})", world));
}

std::shared_ptr<const layout::Checkpoint> build(const std::string& dir) {
  auto fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  EXPECT_TRUE(fd.ok());
  auto entries = source::list_checkpoint_dir(fd->get());
  EXPECT_TRUE(entries.ok());
  EXPECT_TRUE(source::is_checkpoint_dir(fd->get(), *entries));
  source::HeaderCache cache;
  return source::load_checkpoint(fd->get(), *entries, dir, cache, {});
}

std::string problems(const layout::Checkpoint& ck) {
  std::string s;
  for (const auto& p : ck.problems) s += p.to_string() + "\n";
  return s;
}

// ---- a stored zip archive, rewritten ---------------------------------------------------------

void le(std::string& s, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

// The members of a stored zip archive in memory, in order.
std::vector<std::pair<std::string, std::string>> unzip(const std::string& z) {
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > z.size() || out.size() > z.size() - off) return make_error(EIO, "past the end");
    std::memcpy(out.data(), z.data() + off, out.size());
    return {};
  };
  auto m = format::zip::members(z.size(), read, "seed");
  EXPECT_TRUE(m.ok());
  std::vector<std::pair<std::string, std::string>> out;
  if (!m.ok()) return out;
  for (const auto& x : *m) out.emplace_back(x.name, z.substr(x.offset, x.size));
  return out;
}

// A stored zip archive of `members` (no CRC: the reader checks none).
std::string zip(const std::vector<std::pair<std::string, std::string>>& members) {
  std::string out, dir;
  for (const auto& [name, data] : members) {
    const uint64_t local = out.size();
    le(out, 0x04034b50, 4), le(out, 20, 2), le(out, 0, 2), le(out, 0, 2), le(out, 0, 4);
    le(out, 0, 4), le(out, data.size(), 4), le(out, data.size(), 4), le(out, name.size(), 2);
    le(out, 0, 2);
    out += name + data;
    le(dir, 0x02014b50, 4), le(dir, 20, 2), le(dir, 20, 2), le(dir, 0, 2), le(dir, 0, 2);
    le(dir, 0, 4), le(dir, 0, 4), le(dir, data.size(), 4), le(dir, data.size(), 4);
    le(dir, name.size(), 2), le(dir, 0, 2), le(dir, 0, 2), le(dir, 0, 2), le(dir, 0, 2);
    le(dir, 0, 4), le(dir, local, 4);
    dir += name;
  }
  const uint64_t dir_at = out.size();
  out += dir;
  le(out, 0x06054b50, 4), le(out, 0, 2), le(out, 0, 2), le(out, members.size(), 2);
  le(out, members.size(), 2), le(out, dir.size(), 4), le(out, dir_at, 4), le(out, 0, 2);
  return out;
}

// A rank file whose data.pkl has `from` replaced by `to` (pickled keys: BINUNICODE, 'X' and a
// 4-byte length).
std::string with_key(const std::string& file, const std::string& from, const std::string& to) {
  auto members = unzip(file);
  auto key = [](const std::string& k) {
    std::string s = "X";
    le(s, k.size(), 4);
    return s + k;
  };
  bool done = false;
  for (auto& [name, data] : members) {
    if (!name.ends_with("/data.pkl")) continue;
    const size_t at = data.find(key(from));
    EXPECT_NE(at, std::string::npos) << from;
    if (at == std::string::npos) continue;
    data.replace(at, key(from).size(), key(to));
    done = true;
  }
  EXPECT_TRUE(done);
  return zip(members);
}

// ---- tests -----------------------------------------------------------------------------------

// The checkpoint as verl wrote it, and as the tests below edit it: served.
TEST(VerlTrust, TheSeedRankFilesRewrittenUnchangedAreServed) {
  test::TempDir t;
  for (int r = 0; r < 3; ++r) {
    test::write_file(t.path() + "/" + rank_name(3, r), zip(unzip(rank_file(r))));
  }
  write_config(t.path(), 3);
  auto ck = build(t.path());
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  EXPECT_EQ(ck->tensors.size(), 3u);
}

// verl's default strategy is FSDP1 (FSDP_version 1), which verl always gives a device mesh: its
// rank files hold DTensors as FSDP2's do, and are served alike. Another version is refused.
TEST(VerlTrust, Fsdp1IsServedAsFsdp2AndAnotherVersionIsRefused) {
  test::TempDir t;
  for (int r = 0; r < 3; ++r) test::write_file(t.path() + "/" + rank_name(3, r), rank_file(r));
  for (int version : {1, 2, 3}) {
    SCOPED_TRACE(version);
    test::write_file(t.path() + "/fsdp_config.json",
                     fmt::format(R"({{"FSDP_version": {}, "world_size": 3}})", version));
    auto ck = build(t.path());
    if (version == 3) {
      ASSERT_FALSE(ck->valid());
      EXPECT_NE(problems(*ck).find("FSDP_version 3: verl writes 1 (FSDP) or 2 (FSDP2)"),
                std::string::npos)
          << problems(*ck);
      continue;
    }
    ASSERT_TRUE(ck->valid()) << problems(*ck);
    EXPECT_EQ(ck->tensors.size(), 3u);
  }
}

// A world of hard links to one file: refused from the listing, naming both files, before any
// rank is read (so a link to an unreadable file says nothing else, and a world of 4096 links to
// a 100 MB rank costs no parse). verl writes one file per rank.
TEST(VerlTrust, HardLinkedRanksAreRefusedBeforeAnyRankIsRead) {
  test::TempDir t;
  const int world = 256;
  test::write_file(t.path() + "/" + rank_name(world, 0), "not a zip archive");
  for (int r = 1; r < world; ++r) {
    ASSERT_EQ(::link((t.path() + "/" + rank_name(world, 0)).c_str(),
                     (t.path() + "/" + rank_name(world, r)).c_str()),
              0);
  }
  write_config(t.path(), world);
  auto ck = build(t.path());
  ASSERT_FALSE(ck->valid());
  ASSERT_FALSE(ck->problems.empty());
  const auto& first = ck->problems[0];
  EXPECT_EQ(first.file, rank_name(world, 1)) << problems(*ck);
  EXPECT_NE(first.message.find("the same file as " + rank_name(world, 0)), std::string::npos)
      << problems(*ck);
  EXPECT_NE(first.message.find("hard links"), std::string::npos) << problems(*ck);
  // Every problem is a link (or the count of those left unsaid): no rank was opened, and the
  // messages are bounded, not one per rank.
  EXPECT_LE(ck->problems.size(), 64u);
  for (const auto& p : ck->problems) {
    EXPECT_TRUE(p.message.find("the same file as") != std::string::npos ||
                p.message.find("more problem") != std::string::npos)
        << p.to_string();
  }
  EXPECT_NE(ck->problems.back().message.find("more problem"), std::string::npos) << problems(*ck);

  // One link among real ranks: rank 2 is rank 1's file.
  test::TempDir u;
  for (int r = 0; r < 2; ++r) test::write_file(u.path() + "/" + rank_name(3, r), rank_file(r));
  ASSERT_EQ(::link((u.path() + "/" + rank_name(3, 1)).c_str(),
                   (u.path() + "/" + rank_name(3, 2)).c_str()),
            0);
  write_config(u.path(), 3);
  ck = build(u.path());
  ASSERT_FALSE(ck->valid());
  ASSERT_EQ(ck->problems.size(), 1u) << problems(*ck);
  EXPECT_EQ(ck->problems[0].file, rank_name(3, 2));
  EXPECT_NE(ck->problems[0].message.find("the same file as " + rank_name(3, 1)), std::string::npos)
      << problems(*ck);
}

// The ranks are read one at a time against rank 0, and the first that cannot be served ends
// the reading: a rank after it is never opened.
TEST(VerlTrust, TheFirstRankThatCannotBeServedEndsTheReading) {
  test::TempDir t;
  test::write_file(t.path() + "/" + rank_name(3, 0), rank_file(0));
  test::write_file(t.path() + "/" + rank_name(3, 1), "not a zip archive");
  test::write_file(t.path() + "/" + rank_name(3, 2), "not a zip archive either");
  write_config(t.path(), 3);
  auto ck = build(t.path());
  ASSERT_FALSE(ck->valid());
  ASSERT_EQ(ck->problems.size(), 1u) << problems(*ck);
  EXPECT_EQ(ck->problems[0].file, rank_name(3, 1));
  // A rank that disagrees with rank 0 (another key) is named with the tensor.
  test::write_file(t.path() + "/" + rank_name(3, 1), with_key(rank_file(1), "0.bias", "0.bain"));
  ck = build(t.path());
  ASSERT_FALSE(ck->valid());
  EXPECT_TRUE(std::any_of(ck->problems.begin(), ck->problems.end(), [](const auto& p) {
    return p.file == rank_name(3, 1) && p.tensor == "0.bain" &&
           p.message.find("not in " + rank_name(3, 0)) != std::string::npos;
  })) << problems(*ck);
  EXPECT_TRUE(std::none_of(ck->problems.begin(), ck->problems.end(), [](const auto& p) {
    return p.file == rank_name(3, 2);
  })) << problems(*ck);
}

// A state-dict key is a tensor name from an untrusted file: `__metadata__` (the safetensors
// header's own field) and invalid UTF-8 (the header is JSON) are refused, naming the file and
// the tensor.
TEST(VerlTrust, KeysThatCannotNameATensorAreRefusedNamingTheFileAndTheTensor) {
  struct Case {
    std::string key, says, shown;
  };
  for (const Case& c : {Case{"__metadata__", "a tensor named '__metadata__'", "__metadata__"},
                        Case{"\xff.weight", "not valid UTF-8", "\\xff.weight"}}) {
    SCOPED_TRACE(c.shown);
    test::TempDir t;
    for (int r = 0; r < 3; ++r) {
      test::write_file(t.path() + "/" + rank_name(3, r), with_key(rank_file(r), "0.weight", c.key));
    }
    write_config(t.path(), 3);
    auto ck = build(t.path());
    ASSERT_FALSE(ck->valid());
    ASSERT_FALSE(ck->problems.empty());
    const std::string text = ck->problems[0].to_string();
    EXPECT_NE(text.find(rank_name(3, 0)), std::string::npos) << text;
    EXPECT_NE(text.find(c.says), std::string::npos) << text;
    EXPECT_NE(text.find(c.shown), std::string::npos) << text;
  }
}

}  // namespace

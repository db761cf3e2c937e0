// Unit tests of write/store_checks: may a file under a model name be stored as rank shards in
// its directory, decided on the parsed headers the writer holds (no mount, no Filesystem).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/plan.hpp"
#include "ckptfs/write/store_checks.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using write::StoreChecks;

namespace {

// A consolidated file of F32 tensors, split over `ranks` as the write path would split it: the
// header bytes, their parse and the shard set, all as the writer holds them.
struct Split {
  std::string header;
  std::shared_ptr<const format::Header> parsed;
  layout::ShardSet set;
  std::vector<std::shared_ptr<const format::Header>> shards;
  [[nodiscard]] write::Prospect prospect() const { return {header, parsed, shards}; }
};

Split split(const std::vector<std::pair<std::string, std::vector<uint64_t>>>& tensors,
            uint32_t ranks) {
  std::vector<format::TensorEntry> entries;
  for (const auto& [name, shape] : tensors) {
    format::TensorEntry e;
    e.name = name;
    e.dtype = format::DType::F32;
    e.shape = shape;
    uint64_t n = 4;
    for (uint64_t d : shape) n *= d;
    EXPECT_TRUE(format::append_packed(entries, std::move(e), n).ok());
  }
  Split s;
  s.header = format::serialize_header(entries, {{"format", "pt"}});
  const uint64_t data = entries.empty() ? 0 : entries.back().end;
  auto h = format::parse_header_json(std::string_view(s.header).substr(format::kHeaderLenBytes),
                                     s.header.size() + data, "model");
  EXPECT_TRUE(h.ok()) << h.error().message;
  s.parsed = std::make_shared<const format::Header>(std::move(h).value());
  write::PlanOptions o;
  o.ranks = ranks;
  o.min_split_bytes = 1;
  auto p = write::plan(*s.parsed, o, "model");
  EXPECT_TRUE(p.ok());
  auto set = write::shard_headers(*s.parsed, *p, "model");
  EXPECT_TRUE(set.ok());
  s.set = std::move(set).value();
  for (const auto& sh : s.set.shards) s.shards.push_back(sh.parsed);
  return s;
}

// Writes `s`'s rank shards as file k of m into `dir` (zero data: the checks read headers).
void store(const std::string& dir, const Split& s, uint32_t k, uint32_t m) {
  for (const auto& sh : s.set.shards) {
    test::write_file(dir + "/" + format::shard_file_name(sh.rank + 1, k, m),
                     sh.header + std::string(sh.data_size, '\0'));
  }
}

UniqueFd open_dir(const std::string& path) {
  return UniqueFd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
}

struct Checks {
  source::HeaderCache cache;
  bool written = false;  // what the registry answers for every file
  StoreChecks checks{cache, {}, [this](uint64_t, uint64_t) { return written; }};
};

const std::string k1 = format::model_file_name(1, 2), k2 = format::model_file_name(2, 2);

TEST(StoreChecks, ValidatesTheDirectoryWithTheWritersParses) {
  test::TempDir d;
  store(d.path(), split({{"a", {8, 4}}}, 2), 1, 2);
  auto fd = open_dir(d.path());
  Checks c;
  // The second file, holding what the first does not: the checkpoint is whole with it.
  EXPECT_TRUE(c.checks.validate(fd.get(), d.path(), k2, split({{"b", {6}}}, 2).prospect()).ok());
  // The first file again, replacing its own shards: they are not counted twice.
  EXPECT_TRUE(c.checks.validate(fd.get(), d.path(), k1, split({{"a", {8, 4}}}, 3).prospect()).ok());
  // A tensor the first file already holds: refused, naming the directory and the file.
  auto dup = c.checks.validate(fd.get(), d.path(), k2, split({{"a", {8, 4}}}, 2).prospect());
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error().code, EINVAL);
  EXPECT_NE(dup.error().message.find(d.path() + "/" + k2), std::string::npos)
      << dup.error().message;
  EXPECT_NE(dup.error().message.find("would be invalid"), std::string::npos) << dup.error().message;
  // No tensor: no shard could show it.
  auto none = c.checks.validate(fd.get(), d.path(), k2, split({}, 2).prospect());
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("holds no tensor"), std::string::npos)
      << none.error().message;
  // The rules a WriteFile gets carry the same check.
  auto rules = c.checks.rules(fd.get(), d.path(), k2);
  ASSERT_FALSE(rules.whole);
  ASSERT_TRUE(rules.validate);
  EXPECT_FALSE(rules.validate(k2, split({{"a", {8, 4}}}, 2).prospect()).ok());
  EXPECT_TRUE(rules.validate(k2, split({{"b", {6}}}, 1).prospect()).ok());
}

// The check reads the parses it is given, not bytes: a prospect whose shard parse says another
// tensor than its bytes is judged by the parse.
TEST(StoreChecks, ReadsTheParsesNotTheBytes) {
  test::TempDir d;
  store(d.path(), split({{"a", {8, 4}}}, 2), 1, 2);
  auto fd = open_dir(d.path());
  Checks c;
  const Split good = split({{"b", {6}}}, 1);
  const Split clash = split({{"a", {6}}}, 1);
  write::Prospect mixed{good.header, clash.parsed, clash.shards};
  EXPECT_FALSE(c.checks.validate(fd.get(), d.path(), k2, mixed).ok());
}

TEST(StoreChecks, NameStateTellsStoredFromOthers) {
  test::TempDir d;
  store(d.path(), split({{"a", {8, 4}}}, 2), 1, 2);
  auto fd = open_dir(d.path());
  auto entries = source::list_dir(fd.get());
  ASSERT_TRUE(entries.ok());
  auto mine = StoreChecks::name_state(fd.get(), *entries, k1);
  EXPECT_TRUE(mine.stored);
  EXPECT_FALSE(mine.others);
  EXPECT_TRUE(mine.native.empty());
  auto other = StoreChecks::name_state(fd.get(), *entries, k2);
  EXPECT_FALSE(other.stored);
  EXPECT_TRUE(other.others);
  // Not a model name: nothing is said of it.
  auto plain = StoreChecks::name_state(fd.get(), *entries, "notes.txt");
  EXPECT_FALSE(plain.stored || plain.others);

  Checks c;
  // A whole file under a name that stores one: close() fails and says why.
  auto kept = c.checks.place_whole(fd.get(), d.path(), k1, Error{EINVAL, "x: not safetensors"});
  ASSERT_FALSE(kept.ok());
  EXPECT_NE(kept.error().message.find("keeps the consolidated file"), std::string::npos)
      << kept.error().message;
  auto hidden = c.checks.place_whole(fd.get(), d.path(), k2, Error{EINVAL, "x: not safetensors"});
  ASSERT_FALSE(hidden.ok());
  EXPECT_NE(hidden.error().message.find("would be hidden"), std::string::npos)
      << hidden.error().message;
  // Cut short: kept as received, whatever the directory.
  auto cut = c.checks.place_whole(fd.get(), d.path(), k2, Error{EIO, "x: cut short"});
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.error().code, EIO);
  // A plain directory: a whole file is simply a plain file.
  test::TempDir plain_dir;
  auto pfd = open_dir(plain_dir.path());
  EXPECT_TRUE(c.checks.place_whole(pfd.get(), plain_dir.path(), k1, Error{EINVAL, "x"}).ok());
}

TEST(StoreChecks, NativeDirectoriesKeepFilesWhole) {
  test::TempDir d;
  test::write_file(d.path() + "/.metadata", "not read");
  test::write_file(d.path() + "/__0_0.distcp", "not read");
  auto fd = open_dir(d.path());
  EXPECT_EQ(StoreChecks::native_format(fd.get()), "torch DCP");
  Checks c;
  auto rules = c.checks.rules(fd.get(), d.path(), k1);
  ASSERT_TRUE(rules.whole);
  EXPECT_EQ(rules.whole->code, EINVAL);
  EXPECT_FALSE(rules.validate);
  auto entries = source::list_dir(fd.get());
  ASSERT_TRUE(entries.ok());
  auto ns = StoreChecks::name_state(fd.get(), *entries, k1);
  EXPECT_EQ(ns.native, "torch DCP");
  EXPECT_TRUE(ns.others);
}

// A plain directory showing another model file as written: splitting this one would make the
// directory a checkpoint and hide it, unless that file is itself being written (and so split).
TEST(StoreChecks, SplitWouldHideAPlainModelFile) {
  test::TempDir d;
  test::write_file(d.path() + "/" + k1, "a plain file under a model name");
  auto fd = open_dir(d.path());
  Checks c;
  EXPECT_TRUE(c.checks.split_hides_plain(fd.get(), k2));
  EXPECT_FALSE(c.checks.split_hides_plain(fd.get(), k1));  // itself
  auto rules = c.checks.rules(fd.get(), d.path(), k2);
  ASSERT_TRUE(rules.whole);
  EXPECT_EQ(rules.whole->code, 0);  // quietly whole: shown as written
  c.written = true;
  EXPECT_FALSE(c.checks.split_hides_plain(fd.get(), k2));
  EXPECT_FALSE(c.checks.rules(fd.get(), d.path(), k2).whole);
}

// Beside a consolidator's rank shards (sharded/), a model file holding a header and nothing
// after it (torch writes every file's header first, then reopens each to append its data) does
// not keep the others whole; the same file anywhere else, or with a byte after its header, does.
TEST(StoreChecks, AConsolidatorsHeaderAloneHidesNothing) {
  test::TempDir d;
  const Split s = split({{"a", {4}}}, 1);
  test::write_file(d.path() + "/" + k1, s.header);
  auto fd = open_dir(d.path());
  Checks c;
  EXPECT_TRUE(c.checks.split_hides_plain(fd.get(), k2));  // no sharded/: a plain file shown
  ASSERT_EQ(::mkdir((d.path() + "/sharded").c_str(), 0755), 0);
  EXPECT_FALSE(c.checks.split_hides_plain(fd.get(), k2));
  EXPECT_FALSE(c.checks.rules(fd.get(), d.path(), k2).whole);
  test::write_file(d.path() + "/" + k1, s.header + "x");  // data begun: a file shown as written
  EXPECT_TRUE(c.checks.split_hides_plain(fd.get(), k2));
  test::write_file(d.path() + "/" + k1, s.header.substr(0, s.header.size() - 1));
  EXPECT_TRUE(c.checks.split_hides_plain(fd.get(), k2));  // not even a whole header
}

TEST(StoreChecks, AConsolidatorSavingAgainKeepsItsHeaderForItsWriter) {
  test::TempDir d;
  const Split s = split({{"a", {8, 4}}}, 2);
  store(d.path(), s, 1, 2);
  test::write_file(d.path() + "/" + k1, s.header);  // the second save's header, over k1
  auto fd = open_dir(d.path());
  Checks c;
  const Error why{EINVAL, "x: closed after its header"};
  // With no sharded/ beside it too (torch's consolidate_safetensors_files into any directory).
  EXPECT_TRUE(StoreChecks::consolidators_header(fd.get(), k1));
  EXPECT_TRUE(c.checks.place_whole(fd.get(), d.path(), k1, why).ok());
  ASSERT_EQ(::mkdir((d.path() + "/sharded").c_str(), 0755), 0);
  EXPECT_TRUE(StoreChecks::consolidators_header(fd.get(), k1));
  EXPECT_TRUE(c.checks.place_whole(fd.get(), d.path(), k1, why).ok());
  // Cut short (EIO) is never kept quietly; nor is a file with data begun, or no model name.
  EXPECT_FALSE(c.checks.place_whole(fd.get(), d.path(), k1, Error{EIO, "x: cut short"}).ok());
  test::write_file(d.path() + "/" + k1, s.header + "x");
  EXPECT_FALSE(StoreChecks::consolidators_header(fd.get(), k1));
  EXPECT_FALSE(c.checks.place_whole(fd.get(), d.path(), k1, why).ok());
  test::write_file(d.path() + "/notes.safetensors", s.header);
  EXPECT_FALSE(StoreChecks::consolidators_header(fd.get(), "notes.safetensors"));
}

// A header of no tensors, or of empty tensors only, is a whole file with nothing to come: never
// taken for a consolidator's first step (its close would succeed and the name show nothing,
// on this mount and every later one), so it fails as a file the directory would hide.
TEST(StoreChecks, AHeaderOfNoDataIsAWholeFileNotAConsolidatorsHeader) {
  test::TempDir d;
  const Split s = split({{"a", {8, 4}}}, 2);
  store(d.path(), s, 2, 2);
  auto fd = open_dir(d.path());
  Checks c;
  const Error why{EINVAL, "x: holds no tensor"};
  for (const Split& none : {split({}, 1), split({{"e", {0}}, {"f", {3, 0}}}, 1)}) {
    test::write_file(d.path() + "/" + k1, none.header);
    EXPECT_FALSE(StoreChecks::consolidators_header(fd.get(), k1));
    EXPECT_FALSE(c.checks.place_whole(fd.get(), d.path(), k1, why).ok());
  }
  // Beside sharded/ in a plain directory it is a plain file shown, which a split would hide.
  test::TempDir p;
  test::write_file(p.path() + "/" + k1, split({}, 1).header);
  ASSERT_EQ(::mkdir((p.path() + "/sharded").c_str(), 0755), 0);
  auto pfd = open_dir(p.path());
  EXPECT_TRUE(c.checks.split_hides_plain(pfd.get(), k2));
}

}  // namespace

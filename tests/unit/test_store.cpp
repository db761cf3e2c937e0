// One rank's shard storage (flush/store.hpp) and the version 2 commit record that names
// node-local shards (format/record.hpp), without MPI. The OpenMPI transport around them is
// tested with a real mpirun in tests/python/test_mpi.py.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "ckptfs/flush/store.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
namespace stdfs = std::filesystem;

namespace {

std::unique_ptr<flush::ShardStore> store_in(const test::TempDir& d) {
  auto s = flush::ShardStore::open(d.path());
  EXPECT_TRUE(s.ok());
  return std::move(s).value();
}

std::string read_path(flush::ShardStore& s, const std::string& p, uint64_t size) {
  std::string out(size, '\0');
  auto st = s.read_path(p, size, 0, out.data(), out.size());
  EXPECT_TRUE(st.ok()) << st.error().message;
  return out;
}

}  // namespace

TEST(ShardStore, CreateWriteSealReadDrop) {
  test::TempDir d;
  auto s = store_in(d);
  ASSERT_TRUE(s->create(7, "nl-ab-1", 2, "run/ck", 10).ok());
  const std::string staged = d.path() + "/run/ck/.ckptfs/nl-ab-1/rank-00003";
  ASSERT_TRUE(stdfs::exists(staged));
  EXPECT_EQ(stdfs::file_size(staged), 10u);
  ASSERT_TRUE(s->write(7, 2, 0, "hello").ok());
  ASSERT_TRUE(s->write(7, 2, 5, "world").ok());
  char buf[10];
  ASSERT_TRUE(s->read(7, 2, 0, buf, 10).ok());
  EXPECT_EQ(std::string(buf, 10), "helloworld");
  ASSERT_TRUE(s->sync(7).ok());
  auto p = s->seal(7, 2, "shard-00003-model-00001-of-00001.safetensors");
  ASSERT_TRUE(p.ok()) << p.error().message;
  EXPECT_EQ(*p, "run/ck/.ckptfs/nl-ab-1/shard-00003-model-00001-of-00001.safetensors");
  s->close(7);
  EXPECT_EQ(read_path(*s, *p, 10), "helloworld");
  // The size the record says must be the file's: a changed shard is an error, not its bytes.
  std::string x(10, '\0');
  EXPECT_EQ(s->read_path(*p, 11, 0, x.data(), 10).error().code, ESTALE);
  EXPECT_FALSE(s->read_path(*p, 10, 5, x.data(), 10).ok());  // past its end
  // Replaced under the same name and size: the cached descriptor is not used.
  test::write_file(d.path() + "/" + *p + ".new", "HELLOWORLD");
  stdfs::rename(d.path() + "/" + *p + ".new", d.path() + "/" + *p);
  EXPECT_EQ(read_path(*s, *p, 10), "HELLOWORLD");
  ASSERT_TRUE(s->drop("run/ck/.ckptfs/nl-ab-1").ok());
  EXPECT_FALSE(stdfs::exists(d.path() + "/run"));  // the empty parents went too
  EXPECT_TRUE(stdfs::exists(d.path()));
  EXPECT_TRUE(s->drop("run/ck/.ckptfs/nl-ab-1").ok());  // gone already: fine
}

TEST(ShardStore, NothingReachesOutsideTheTarget) {
  test::TempDir outer;
  stdfs::create_directories(outer.path() + "/t");
  stdfs::create_directories(outer.path() + "/secret/.ckptfs/nl-x");
  test::write_file(outer.path() + "/secret/f", "secret");
  auto s = flush::ShardStore::open(outer.path() + "/t");
  ASSERT_TRUE(s.ok());
  auto& st = **s;
  EXPECT_FALSE(st.create(1, "nl-a", 0, "../secret", 4).ok());
  EXPECT_FALSE(st.create(1, "nl-a", 0, "/abs", 4).ok());
  EXPECT_FALSE(st.create(1, "tx-a", 0, "d", 4).ok());  // not a node-local name
  EXPECT_FALSE(st.create(1, "nl-a/..", 0, "d", 4).ok());
  std::string buf(6, '\0');
  EXPECT_FALSE(st.read_path("../secret/f", 6, 0, buf.data(), 6).ok());
  EXPECT_FALSE(st.drop("../secret/.ckptfs/nl-x").ok());
  EXPECT_FALSE(st.drop("d/notstate/nl-x").ok());
  // A symlink in the target is never followed, not even to a directory it could make.
  ASSERT_EQ(::symlink((outer.path() + "/secret").c_str(), (outer.path() + "/t/link").c_str()), 0);
  EXPECT_FALSE(st.create(1, "nl-a", 0, "link", 4).ok());
  EXPECT_FALSE(st.read_path("link/f", 6, 0, buf.data(), 6).ok());
  EXPECT_FALSE(stdfs::exists(outer.path() + "/secret/.ckptfs/nl-a"));
  EXPECT_TRUE(stdfs::exists(outer.path() + "/secret/.ckptfs/nl-x"));
}

TEST(ShardStore, AFailedWriteIsLatchedAndNeverReadBack) {
  test::TempDir d;
  auto s = store_in(d);
  s->inject_enospc_after(4);
  ASSERT_TRUE(s->create(1, "nl-f-1", 0, "", 8).ok());
  EXPECT_TRUE(s->write(1, 0, 0, "abcd").ok());
  auto w = s->write(1, 0, 4, "efgh");
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code, ENOSPC);
  char buf[8];
  EXPECT_EQ(s->read(1, 0, 0, buf, 4).error().code, ENOSPC);
  EXPECT_EQ(s->sync(1).error().code, ENOSPC);
  EXPECT_FALSE(s->seal(1, 0, "shard-00001-model-00001-of-00001.safetensors").ok());
  s->abort(1);  // nothing committed: its directory goes
  EXPECT_FALSE(stdfs::exists(d.path() + "/.ckptfs/nl-f-1"));
}

TEST(ShardStore, SweepKeepsWhatRecordsNameAndWhatIsLive) {
  test::TempDir d;
  auto s = store_in(d);
  for (const char* n : {"nl-old-1", "nl-old-2"}) {
    stdfs::create_directories(d.path() + "/a/b/.ckptfs/" + std::string(n));
  }
  stdfs::create_directories(d.path() + "/a/.ckptfs/tx-local");  // not ours: never swept
  ASSERT_TRUE(s->create(3, "nl-live-3", 0, "a", 4).ok());
  auto n = s->sweep({"nl-old-2"});
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1u);
  EXPECT_FALSE(stdfs::exists(d.path() + "/a/b/.ckptfs/nl-old-1"));
  EXPECT_TRUE(stdfs::exists(d.path() + "/a/b/.ckptfs/nl-old-2"));
  EXPECT_TRUE(stdfs::exists(d.path() + "/a/.ckptfs/nl-live-3"));
  EXPECT_TRUE(stdfs::exists(d.path() + "/a/.ckptfs/tx-local"));
}

namespace {

// A version 2 record of one single-tensor file stored as one node-local shard.
format::Record remote_record() {
  test::ShardSpec sp{"shard-00001-model-00001-of-00001.safetensors",
                     {{"w", format::DType::F32, {0}, {4}, std::vector<uint64_t>{4}, {}}}};
  const std::string shard = test::make_shard_bytes(sp);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(shard[i]);
  auto sh_h = *format::parse_header_json(shard.substr(8, n), shard.size(), "s");
  const std::string file_json = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  format::Record r;
  r.name = "model.safetensors";
  r.size = 8 + std::string(file_json).size() + 16;
  r.header = std::string(8, '\0') + file_json;
  r.header[0] = static_cast<char>(file_json.size());
  format::RecordShard s;
  s.name = sp.file_name;
  s.size = shard.size();
  s.owner = 2;
  s.path = "ck/.ckptfs/nl-a-1/" + sp.file_name;
  s.header = shard.substr(0, sh_h.data_start());
  r.shards.push_back(s);
  return r;
}

}  // namespace

// The one parser of record file names, record_file_name's inverse.
TEST(Record, RecordNamesParseBackToTheirFile) {
  for (const char* f : {"model.safetensors", "model-00002-of-00003.safetensors", "x.commit"}) {
    EXPECT_EQ(format::parse_record_name(format::record_file_name(f)), std::string_view(f));
    EXPECT_EQ(format::parse_record_name(".ckptfs/" + format::record_file_name(f)),
              std::string_view(f));
  }
  for (const char* bad : {"", ".commit", ".ckptfs/.commit", "model.safetensors", "model.commi",
                          ".ckptfs/", ".ckptfsX.commit"}) {
    SCOPED_TRACE(bad);
    if (std::string_view(bad) == ".ckptfsX.commit") {  // a file named so, not the state dir
      EXPECT_EQ(format::parse_record_name(bad), std::string_view(".ckptfsX"));
      continue;
    }
    EXPECT_FALSE(format::parse_record_name(bad).has_value());
  }
}

TEST(Record, Version2NamesOwnerPathAndHeader) {
  auto r = remote_record();
  const std::string text = format::serialize_record(r);
  EXPECT_NE(text.find("\"ckptfs_record\":2"), std::string::npos);
  auto back = format::parse_record(text, "rec");
  ASSERT_TRUE(back.ok()) << back.error().message;
  ASSERT_TRUE(back->remote());
  EXPECT_EQ(back->shards[0].owner, 2);
  EXPECT_EQ(back->shards[0].path, r.shards[0].path);
  EXPECT_EQ(back->shards[0].header, r.shards[0].header);
  ASSERT_TRUE(back->shards[0].parsed);
  EXPECT_EQ(back->shards[0].parsed->tensors.size(), 1u);
}

TEST(Record, Version2IsStrict) {
  auto bad = [](auto edit) {
    auto r = remote_record();
    edit(r);
    return !format::parse_record(format::serialize_record(r), "rec").ok();
  };
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].owner = 100000; }));
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].path = "../" + r.shards[0].name; }));
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].path = "/abs/" + r.shards[0].name; }));
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].path = "a//" + r.shards[0].name; }));
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].path = "a/other.safetensors"; }));
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].size += 1; }));  // header vs size
  EXPECT_TRUE(bad([](format::Record& r) { r.shards[0].header = std::string(8, '\0') + "{"; }));
  // A version 1 record may not carry version 2 fields.
  auto r = remote_record();
  std::string text = format::serialize_record(r);
  text.replace(text.find("\"ckptfs_record\":2"), 17, "\"ckptfs_record\":1");
  EXPECT_FALSE(format::parse_record(text, "rec").ok());
}

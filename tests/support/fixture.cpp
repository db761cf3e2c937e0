#include "fixture.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <fmt/format.h>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/checked.hpp"

namespace ckptfs::test {

std::string make_shard_bytes(const ShardSpec& spec) {
  std::vector<format::TensorEntry> entries;
  format::ShardingInfo info;
  std::string data;
  for (const auto& c : spec.chunks) {
    format::TensorEntry e;
    e.name = c.name;
    e.dtype = c.dtype;
    e.shape = c.sizes;
    uint64_t n = *format::byte_size(c.dtype, *checked_numel(c.sizes));
    e.begin = data.size();
    e.end = e.begin + n;
    if (c.data.empty()) {
      data.append(n, '\0');
    } else {
      if (c.data.size() != n) throw std::runtime_error("chunk data size mismatch for " + c.name);
      data += c.data;
    }
    entries.push_back(e);
    info[c.name] = format::ShardingEntry{c.offsets, c.full_shape};
  }
  std::map<std::string, std::string> md{{"format", "pt"}};
  if (spec.sharding_info) {
    md[std::string(format::kShardingInfoKey)] = format::serialize_sharding_info(info);
    md[std::string(format::kDcpVersionKey)] = "1.0";
  }
  return format::serialize_header(entries, md) + data;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ckptfs-test-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void copy_bits(const std::string& src, uint64_t src_bit, std::string& dst, uint64_t dst_bit,
               uint64_t nbits) {
  if (src_bit % 8 == 0 && dst_bit % 8 == 0 && nbits % 8 == 0) {
    std::copy_n(src.data() + src_bit / 8, nbits / 8, dst.data() + dst_bit / 8);
    return;
  }
  for (uint64_t i = 0; i < nbits; ++i) {
    uint64_t sb = src_bit + i, db = dst_bit + i;
    bool v = (static_cast<unsigned char>(src[sb / 8]) >> (sb % 8)) & 1;
    auto& d = reinterpret_cast<unsigned char&>(dst[db / 8]);
    d = static_cast<unsigned char>(v ? (d | (1u << (db % 8))) : (d & ~(1u << (db % 8))));
  }
}

std::string slice_chunk(const std::string& full, const std::vector<uint64_t>& shape,
                        format::DType dtype, const std::vector<uint64_t>& offsets,
                        const std::vector<uint64_t>& sizes) {
  const uint64_t bits = format::dtype_bits(dtype);
  const uint64_t n = *checked_numel(sizes);
  std::string out(*format::byte_size(dtype, n), '\0');
  const size_t r = shape.size();
  std::vector<uint64_t> x(r, 0);
  for (uint64_t i = 0; i < n; ++i) {
    // x = coordinates of chunk element i
    uint64_t rem = i;
    for (size_t d = r; d-- > 0;) {
      x[d] = rem % sizes[d];
      rem /= sizes[d];
    }
    uint64_t lin = 0;
    for (size_t d = 0; d < r; ++d) lin = lin * shape[d] + (offsets[d] + x[d]);
    copy_bits(full, lin * bits, out, i * bits, bits);
  }
  return out;
}

layout::ShardInput shard_input(const std::string& name, const std::string& bytes) {
  layout::ShardInput in;
  in.name = name;
  in.stamp.size = bytes.size();
  auto h = format::parse_file_bytes(bytes, name);
  if (h) {
    in.header = std::make_shared<const format::Header>(std::move(h).value());
  } else {
    in.error = h.error().message;
    if (in.error.starts_with(name + ": ")) in.error.erase(0, name.size() + 2);
  }
  return in;
}

std::string random_bytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

std::map<std::string, std::string> add_shards(layout::BuildInput& in,
                                              const std::vector<ShardSpec>& specs) {
  std::map<std::string, std::string> files;
  for (const auto& s : specs) {
    auto bytes = make_shard_bytes(s);
    in.shards.push_back(shard_input(s.file_name, bytes));
    files[s.file_name] = std::move(bytes);
  }
  return files;
}

std::string consolidated(uint64_t seed, uint64_t rows, std::string_view prefix) {
  std::mt19937_64 rng(seed);
  const uint64_t w = rows * 64 * 4, b = 64 * 4, e = 3 * 4;
  std::string json =
      fmt::format(R"({{"{3}z.weight": {{"dtype":"F32","shape":[{0},64],"data_offsets":[0,{1}]}}, )"
                  R"("{3}a.bias":{{"dtype":"F32","shape":[64],"data_offsets":[{1},{2}]}},)"
                  R"("{3}m.embed":{{"dtype":"F32","shape":[3],"data_offsets":[{2},{4}]}},)"
                  R"("__metadata__":{{"format":"pt","note":"kept"}}}})",
                  rows, w, w + b, prefix, w + b + e);
  json.append(13, ' ');
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');
  std::string out = format::with_length_prefix(json);
  out += random_bytes(rng, w + b + e);
  return out;
}

}  // namespace ckptfs::test

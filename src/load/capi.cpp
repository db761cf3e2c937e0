// The C API (include/ckptfs/load/ckptfs_load.h) over the loader.
#include "ckptfs/load/ckptfs_load.h"

#include <cstring>
#include <string>
#include <vector>

#include "ckptfs/load/loader.hpp"

struct ckptfs_load_ckpt {
  std::unique_ptr<ckptfs::load::Source> src;
  std::vector<std::string> dtypes;          // dtype name per tensor (NUL-terminated for callers)
  std::vector<ckptfs::load::Buffer> owned;  // destinations allocated for the caller
  std::string error;
};

struct ckptfs_load_comm {
  std::unique_ptr<ckptfs::load::Collective> coll;
};

namespace {

using ckptfs::Error;

int report(const Error& e, char* err, size_t len) {
  if (err && len > 0) {
    const size_t n = std::min(len - 1, e.message.size());
    std::memcpy(err, e.message.data(), n);
    err[n] = '\0';
  }
  return e.code > 0 ? e.code : EIO;
}

int fail(ckptfs_load_ckpt* ck, Error e) {
  ck->error = std::move(e.message);
  return e.code > 0 ? e.code : EIO;
}

// No exception crosses the C API: `body` runs under guard, and one it lets out becomes ENOMEM
// (bad_alloc) or EIO, with its text passed to `report`.
template <typename Body, typename Report>
int guard(Body&& body, Report&& report) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return report(Error{ENOMEM, "out of memory"});
  } catch (const std::exception& e) {
    return report(Error{EIO, e.what()});
  } catch (...) {
    return report(Error{EIO, "unknown exception"});
  }
}

}  // namespace

extern "C" {

int ckptfs_load_features(void) {
  return (ckptfs::load::built_with_cuda() ? 1 : 0) | (ckptfs::load::built_with_nccl() ? 2 : 0);
}

int ckptfs_load_huge_pages(void) { return ckptfs::load::huge_pages_pay_here() ? 1 : 0; }

int ckptfs_load_open(const char* dir, const char* dtype, int direct, ckptfs_load_ckpt** out,
                     char* err, size_t err_len) {
  return ckptfs_load_open_map(dir, dtype, nullptr, nullptr, direct, out, err, err_len);
}

int ckptfs_load_open_map(const char* dir, const char* dtype, const char* map, const char* hf_config,
                         int direct, ckptfs_load_ckpt** out, char* err, size_t err_len) {
  if (!dir || !out) return report(Error{EINVAL, "dir and out are required"}, err, err_len);
  *out = nullptr;
  return guard(
      [&] {
        ckptfs::load::SourceOptions so;
        if (dtype) so.dtype = dtype;
        if (map) so.map = map;
        if (hf_config) so.hf_config = hf_config;
        so.direct = direct != 0;
        auto src = ckptfs::load::Source::open(dir, so);
        if (!src) return report(src.error(), err, err_len);
        auto ck = std::make_unique<ckptfs_load_ckpt>();
        ck->src = std::move(*src);
        for (const auto& t : ck->src->tensors()) {
          ck->dtypes.emplace_back(ckptfs::format::dtype_name(t.dtype));
        }
        *out = ck.release();
        return 0;
      },
      [&](const Error& e) { return report(e, err, err_len); });
}

void ckptfs_load_close(ckptfs_load_ckpt* ck) { delete ck; }

const char* ckptfs_load_error(const ckptfs_load_ckpt* ck) { return ck ? ck->error.c_str() : ""; }

size_t ckptfs_load_count(const ckptfs_load_ckpt* ck) { return ck ? ck->src->tensors().size() : 0; }

int ckptfs_load_info(const ckptfs_load_ckpt* ck, size_t i, const char** name, const char** dtype,
                     size_t* ndim, const uint64_t** shape, uint64_t* nbytes) {
  if (!ck || i >= ck->src->tensors().size()) return EINVAL;
  const auto& t = ck->src->tensors()[i];
  if (name) *name = t.name.c_str();
  if (dtype) *dtype = ck->dtypes[i].c_str();
  if (ndim) *ndim = t.shape.size();
  if (shape) *shape = t.shape.data();
  if (nbytes) *nbytes = t.nbytes;
  return 0;
}

int ckptfs_load_run(ckptfs_load_ckpt* ck, ckptfs_load_request* reqs, size_t n,
                    const ckptfs_load_options* options, ckptfs_load_comm* comm,
                    ckptfs_load_stats* stats, uint64_t* checksums) {
  if (!ck) return EINVAL;
  if (n > 0 && !reqs) return fail(ck, Error{EINVAL, "no requests"});
  return guard(
      [&] {
        ckptfs::load::LoadOptions lo;
        std::string device = "cpu";
        if (options) {
          if (options->device) device = options->device;
          lo.threads = options->threads;
          if (options->chunk_bytes) lo.chunk = options->chunk_bytes;
          lo.ring_slots = options->ring_slots;
          if (options->streams) lo.streams = options->streams;
          lo.checksum = options->checksum != 0;
          if (options->always_stage) lo.staging = ckptfs::load::LoadOptions::Staging::Always;
        }
        auto backend = ckptfs::load::make_backend(device, ckptfs::load::huge_pages_pay_here());
        if (!backend) return fail(ck, backend.error());
        std::vector<ckptfs::load::Request> rs(n);
        for (size_t i = 0; i < n; ++i) {
          if (!reqs[i].name) return fail(ck, Error{EINVAL, "a request has no tensor name"});
          rs[i].name = reqs[i].name;
          rs[i].dst = reqs[i].dst;
          rs[i].bytes = reqs[i].bytes;
          if (reqs[i].has_rows) rs[i].rows = std::make_pair(reqs[i].row_begin, reqs[i].row_end);
        }
        auto r = ckptfs::load::load(*ck->src, rs, **backend, lo, comm ? comm->coll.get() : nullptr);
        if (!r) return fail(ck, r.error());
        for (size_t i = 0; i < n; ++i) reqs[i].dst = rs[i].dst;
        for (auto& b : r->owned) ck->owned.push_back(std::move(b));
        if (stats) {
          stats->bytes = r->stats.bytes;
          stats->bytes_read = r->stats.bytes_read;
          stats->bytes_shared = r->stats.bytes_shared;
          stats->seconds = r->stats.seconds;
          stats->direct_fallback = r->stats.direct_fallback ? 1 : 0;
        }
        if (checksums && lo.checksum) {
          std::copy(r->stats.checksums.begin(), r->stats.checksums.end(), checksums);
        }
        return 0;
      },
      [&](const Error& e) { return fail(ck, e); });
}

int ckptfs_load_nccl_unique_id(unsigned char id[128], char* err, size_t err_len) {
  return guard(
      [&] {
        auto r = ckptfs::load::nccl_unique_id();
        if (!r) return report(r.error(), err, err_len);
        std::memcpy(id, r->data(), r->size());
        return 0;
      },
      [&](const Error& e) { return report(e, err, err_len); });
}

int ckptfs_load_comm_open(const unsigned char id[128], unsigned rank, unsigned ranks, int device,
                          ckptfs_load_comm** out, char* err, size_t err_len) {
  if (!id || !out) return report(Error{EINVAL, "id and out are required"}, err, err_len);
  *out = nullptr;
  return guard(
      [&] {
        ckptfs::load::NcclId nid{};
        std::memcpy(nid.data(), id, nid.size());
        auto c = ckptfs::load::make_nccl_collective(nid, rank, ranks, device);
        if (!c) return report(c.error(), err, err_len);
        *out = new ckptfs_load_comm{std::move(*c)};
        return 0;
      },
      [&](const Error& e) { return report(e, err, err_len); });
}

void ckptfs_load_comm_close(ckptfs_load_comm* comm) { delete comm; }

}  // extern "C"

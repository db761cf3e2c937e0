// The loader: a checkpoint's tensors into caller memory (host or one GPU), through a pool of
// reader threads and a bounded ring of staging buffers.
//
//   requests -> pieces of at most `chunk` bytes -> T reader threads, each:
//     take a free ring slot (waiting for its last copy's event) -> Source::read into it
//     (extent map + io::gather, or pread of a consolidated file) -> optional checksum of
//     the piece -> Backend::copy (cudaMemcpyAsync on stream t % S + event, or memcpy)
//     -> the slot goes back to the ring.
//   Memory: ring_slots x chunk bytes of staging, whatever the checkpoint size.
//   Host destinations (the CPU backend) skip the ring by default (Staging::Auto): each piece
//   is produced straight into the destination, saving a memcpy; Staging::Always runs the
//   device pipeline unchanged with memcpy as the copy (what CI tests of the GPU path's logic).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/load/backend.hpp"
#include "ckptfs/load/collective.hpp"
#include "ckptfs/load/source.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::load {

inline constexpr uint64_t kDefaultChunk = 16ull << 20;
// The most reader threads, ring slots and streams a load takes (EINVAL beyond): the CLI, the C
// API and the binding all go through load(), which checks.
inline constexpr unsigned kMaxThreads = 256;
inline constexpr unsigned kMaxRingSlots = 4096;
inline constexpr unsigned kMaxStreams = 64;

// Reader threads when none is asked for: one per core, at least 2, at most 16.
unsigned default_threads();

struct LoadOptions {
  unsigned threads = 0;            // 0: default_threads()
  uint64_t chunk = kDefaultChunk;  // staging buffer bytes; a multiple of kChecksumBlock
  unsigned ring_slots = 0;         // 0: 2 x threads
  unsigned streams = 4;            // CUDA streams the copies are spread over
  bool checksum = false;           // fill LoadStats::checksums
  // Auto: through the ring for a device, straight into host destinations. Always: the ring
  // for every backend.
  enum class Staging : uint8_t { Auto, Always };
  Staging staging = Staging::Auto;
};

struct Request {
  std::string name;
  // Destination (host or device memory, as the backend). nullptr: the loader allocates it
  // (Backend::alloc_dest), returns it in LoadResult::owned and writes the pointer here.
  void* dst = nullptr;
  uint64_t bytes = 0;  // must equal the bytes of the tensor or of the slice
  // Rows [first, second) along dim 0 (tensor-parallel slices); whole tensor when unset.
  // The tensor must have at least one dimension and whole-byte rows.
  std::optional<std::pair<uint64_t, uint64_t>> rows;
};

struct LoadStats {
  uint64_t bytes = 0;         // bytes delivered into this rank's destinations
  uint64_t bytes_read = 0;    // bytes this rank read from storage
  uint64_t bytes_shared = 0;  // bytes received from other ranks (collective loads)
  double seconds = 0;
  bool direct_fallback = false;
  std::vector<uint64_t> checksums;  // per request (LoadOptions::checksum), see checksum.hpp
};

struct LoadResult {
  LoadStats stats;
  std::vector<Buffer> owned;  // destinations the loader allocated
};

// Checks requests against the source: known names (the error names the tensor), sizes equal
// to the tensor's or slice's bytes, slices in range. Returns each request's tensor index and
// byte offset within it.
struct Resolved {
  uint32_t tensor = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
Result<std::vector<Resolved>> resolve(const Source& src, std::span<const Request> reqs);

// A request for every tensor of the source, in its order, with no destination (allocated).
std::vector<Request> all_tensors(const Source& src);

// The checksum (checksum.hpp) of `bytes` of destination memory, copied back to the host a
// chunk at a time when the backend is a device.
Result<uint64_t> checksum_dest(Backend& backend, const void* dst, uint64_t bytes,
                               uint64_t chunk = kDefaultChunk);

// One checksum for a whole checkpoint: XXH64 over (name, NUL, 8-byte little-endian checksum)
// of every tensor, in name order (so independent of file layout and tensor order).
uint64_t combine_checksums(std::vector<std::pair<std::string, uint64_t>> named);

// Loads every request. With a collective, every rank must pass the same requests (names,
// sizes, slices; compared across ranks first, EINVAL on every rank otherwise): each reads its
// share and the rest arrives by broadcast. A rank that fails makes every rank fail.
Result<LoadResult> load(const Source& src, std::span<Request> reqs, Backend& backend,
                        const LoadOptions& opts = {}, Collective* collective = nullptr);

}  // namespace ckptfs::load

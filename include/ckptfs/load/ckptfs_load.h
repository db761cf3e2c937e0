/* The ckptfs loader's C API: load a checkpoint (rank shards or consolidated safetensors)
 * into host or GPU memory. Built as libckptfs_load.so; the Python binding
 * (python/ckptfs_load) uses it through ctypes.
 *
 * Every function returning int returns 0 on success or a positive errno value; the message
 * is then in ckptfs_load_error(handle) (or in `err` for the calls that make a handle).
 * Handles are opaque and not thread-safe: one thread at a time per handle. */
#ifndef CKPTFS_LOAD_H
#define CKPTFS_LOAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CKPTFS_LOAD_API_VERSION 1

typedef struct ckptfs_load_ckpt ckptfs_load_ckpt; /* an opened, validated checkpoint */
typedef struct ckptfs_load_comm ckptfs_load_comm; /* an NCCL communicator */

typedef struct {
  const char* name; /* tensor name */
  void* dst;        /* destination (host, or device memory for cuda); NULL: allocated by the
                       library, owned by the ckpt handle, and the pointer written back here */
  uint64_t bytes;   /* must equal the tensor's (or the slice's) bytes */
  uint64_t row_begin, row_end; /* rows [row_begin, row_end) of dim 0 when has_rows */
  int has_rows;
} ckptfs_load_request;

typedef struct {
  const char* device;   /* "cpu" (also NULL) or "cuda:N" */
  unsigned threads;     /* reader threads; 0: one per core, 2..16 */
  uint64_t chunk_bytes; /* staging buffer size, a multiple of 1 MiB; 0: 16 MiB */
  unsigned ring_slots;  /* staging buffers; 0: 2 x threads */
  unsigned streams;     /* CUDA streams; 0: 4 */
  int checksum;         /* fill `checksums` of ckptfs_load_run (see docs/loader.md) */
  int always_stage;     /* host destinations through the staging ring too (default: straight) */
} ckptfs_load_options;

typedef struct {
  uint64_t bytes;        /* delivered into this process's destinations */
  uint64_t bytes_read;   /* read from storage by this process */
  uint64_t bytes_shared; /* received from other ranks */
  double seconds;
  int direct_fallback; /* O_DIRECT was asked for and some reads were buffered */
} ckptfs_load_stats;

/* Bit 0: built with CUDA; bit 1: built with NCCL. */
int ckptfs_load_features(void);

/* 1 when fresh host memory is advised for transparent huge pages here (MADV_HUGEPAGE): not
 * under a virtio balloon that reports free pages; $CKPTFS_LOAD_HUGEPAGES=1 or 0 forces it.
 * Destinations the library allocates follow it; the Python binding asks it for the torch
 * tensors it allocates. */
int ckptfs_load_huge_pages(void);

/* Opens `dir`. dtype: NULL or "auto" (as the mount), "stored", "bf16", "fp16", "fp32" (rank
 * shards only). direct: also read long runs with O_DIRECT. A checkpoint with problems is
 * refused (EINVAL) with every problem in `err`. */
int ckptfs_load_open(const char* dir, const char* dtype, int direct, ckptfs_load_ckpt** out,
                     char* err, size_t err_len);
/* The same with a model map (docs/maps.md): map is NULL or "" (built-ins detected), "none", a
 * built-in's name or a .json path; hf_config is NULL or a config.json path for a checkpoint
 * without its own. The tensors are then the map's HF tensors. */
int ckptfs_load_open_map(const char* dir, const char* dtype, const char* map, const char* hf_config,
                         int direct, ckptfs_load_ckpt** out, char* err, size_t err_len);
void ckptfs_load_close(ckptfs_load_ckpt* ck);
const char* ckptfs_load_error(const ckptfs_load_ckpt* ck);

size_t ckptfs_load_count(const ckptfs_load_ckpt* ck);
/* Tensor i: name, dtype name ("BF16"), dims and shape, bytes. Pointers live as long as ck. */
int ckptfs_load_info(const ckptfs_load_ckpt* ck, size_t i, const char** name, const char** dtype,
                     size_t* ndim, const uint64_t** shape, uint64_t* nbytes);

/* Loads n requests. comm: NULL, or a communicator all of whose ranks call this with the same
 * requests (each reads its share; the rest arrives by broadcast). stats and checksums (n
 * values, with options->checksum) may be NULL. */
int ckptfs_load_run(ckptfs_load_ckpt* ck, ckptfs_load_request* reqs, size_t n,
                    const ckptfs_load_options* options, ckptfs_load_comm* comm,
                    ckptfs_load_stats* stats, uint64_t* checksums);

/* NCCL (ENOTSUP when built without it): rank 0 makes the id and hands it to the others. */
int ckptfs_load_nccl_unique_id(unsigned char id[128], char* err, size_t err_len);
int ckptfs_load_comm_open(const unsigned char id[128], unsigned rank, unsigned ranks, int device,
                          ckptfs_load_comm** out, char* err, size_t err_len);
void ckptfs_load_comm_close(ckptfs_load_comm* comm);

#ifdef __cplusplus
}
#endif

#endif /* CKPTFS_LOAD_H */

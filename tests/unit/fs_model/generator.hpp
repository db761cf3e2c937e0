// fs_model/generator: picks each step's op from the model's state and the sequence's rng (what
// it never generates, and why, is said at each pick).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "model.hpp"

namespace ckptfs::fsmodel {

// A consolidated safetensors file (as save_pretrained writes it, with a header laid out unlike
// ckptfs's own so an exact read-back proves the header was kept). Tensor names carry `prefix`.
std::string tensors_file(std::mt19937_64& rng, const std::string& prefix);
// Bytes that are no safetensors file (the length prefix is far past the 100 MB header limit).
std::string plain_file(std::mt19937_64& rng);

// Same model state and rng state: the same op. The runner draws from the same rng (read
// splits), so a seed makes the same sequence as long as the drivers answer alike.
class Generator {
 public:
  Generator(const Model& m, std::mt19937_64& rng) : m_(m), rng_(rng) {}

  // The next step's op (kind None where the pick does not apply this time).
  Op next();
  // The end of a sequence: the rest of the pieces of the lowest-numbered open writer, then its
  // close (the model has one open).
  std::vector<Op> finish_one() const;

  uint64_t pick(uint64_t n) { return rng_() % n; }

 private:
  template <typename T>
  const T& pick_of(const std::vector<T>& v) {
    return v[pick(v.size())];
  }
  std::string pick_dir();
  std::string pick_name(const Dir& d, bool model_bias = false);
  Op close_op(const Handle& h) const;

  Op op_create();
  Op op_write();
  Op op_close(bool mid);
  Op op_fsync();
  Op op_rename();
  Op rename_dir();
  Op op_unlink();
  Op op_mkdir();
  Op op_rmdir();
  Op op_src_change();

  const Model& m_;
  std::mt19937_64& rng_;
};

}  // namespace ckptfs::fsmodel

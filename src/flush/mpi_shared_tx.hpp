// flush/mpi_shared_tx (internal to flush/, OpenMPI builds only): the shared-target
// transaction, where every rank sees SRC and writes its shards into the staging the head made.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/flush/mpi.hpp"

namespace ckptfs::flush::mpi {

class Link;

// A shared-target transaction over `local` (the local flusher's transaction: the staging in
// SRC, the head's own shards, the commit): shard i goes to rank owners[i], which opens its
// staged file <rel>/.ckptfs/<staging>/rank-0000{i+1} now (all or nothing: on failure, every
// owner is told to forget it). The head's own shard writes are capped by `rate`.
Result<std::unique_ptr<Transaction>> begin_shared(std::unique_ptr<Transaction> local, Link& link,
                                                  uint64_t tx, std::vector<int> owners,
                                                  std::string what, RateLimiter& rate,
                                                  const std::string& rel);

}  // namespace ckptfs::flush::mpi

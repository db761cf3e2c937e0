// flush/mpi_node_local (internal to flush/, OpenMPI builds only): node-local targets
// (-o target=): the transaction that makes, writes and seals each shard on its owner's own
// ShardStore, the reader of committed shards, the removal of replaced files' shards, and the
// mount's sweep of what no record names.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/flush/store.hpp"
#include "ckptfs/util/fd.hpp"

namespace ckptfs::flush::mpi {

class Link;

// Where a shard lives: rank 0's own ShardStore, or another rank's over the Link.
struct Owners {
  Link& link;
  ShardStore& self;
};

// A node-local transaction named `txname` (nl-...) for the file whose directory is `rel`
// (relative to SRC; `dir` is that directory, `display` its path in messages) over `local` (the
// local flusher's transaction: SRC's lock and, at the commit, the record): shard i is made on
// rank owner_of(i, nranks) now (all or nothing: on failure, what was made is removed). The
// head's own shard writes are capped by `rate`.
Result<std::unique_ptr<Transaction>> begin_node_local(std::unique_ptr<Transaction> local,
                                                      Owners& owners, uint64_t tx,
                                                      std::string txname, std::string rel,
                                                      UniqueFd dir, std::string display,
                                                      const layout::ShardSet& set, int nranks,
                                                      std::string what, RateLimiter& rate);

// Committed node-local shards, read for the view: rank 0's from its own store, the others'
// with ReadPath requests.
std::shared_ptr<const io::ShardReader> make_node_local_reader(Owners& owners);

// The node-local directories of the record of file k of m in `dirfd`'s .ckptfs, if it is a
// version 2 record: (owner, directory) pairs, each once.
std::vector<std::pair<int, std::string>> remote_dirs(int dirfd, uint32_t k, uint32_t m,
                                                     const std::string& display);

// Removes node-local directories of a replaced or removed file. Best effort: what is left is
// garbage no record names, which the next mount's sweep removes; the commit stands either way.
void drop_dirs(Owners& owners, const std::vector<std::pair<int, std::string>>& dirs,
               std::string_view what);

// At mount: removes, on every rank, the node-local directories no record under `source` names
// (writes a crash cut short, replaced files whose removal was cut short). Nothing is removed
// when some record cannot be read.
void sweep_node_local(Owners& owners, const std::string& source);

}  // namespace ckptfs::flush::mpi

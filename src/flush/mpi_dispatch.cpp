// flush/mpi_dispatch: what a rank does with one command of the head on its ShardStore
// (include/ckptfs/flush/mpi.hpp, dispatch). No MPI here: always built, tested without mpirun in
// tests/unit/test_mpi_dispatch.cpp; the MPI loop around it is flush/mpi_rank.cpp.
#include <set>
#include <string>

#include "ckptfs/flush/mpi.hpp"

namespace ckptfs::flush::mpi {
namespace {

std::optional<Answer> answer(const Command& c, int err, std::string_view payload) {
  if (c.id == 0) return std::nullopt;  // nobody waits for it
  Answer a;
  a.reply.id = c.id;
  a.reply.err = err;
  a.payload.assign(payload);
  return a;
}

std::optional<Answer> answer_error(const Command& c, const Error& e) {
  return answer(c, e.code > 0 ? e.code : EIO, e.message);
}

std::optional<Answer> answer_status(const Command& c, const Status& st) {
  return st ? answer(c, 0, {}) : answer_error(c, st.error());
}

// Sweep's payload: names separated by '\0'.
std::set<std::string, std::less<>> split_names(std::string_view payload) {
  std::set<std::string, std::less<>> keep;
  for (std::string_view rest = payload; !rest.empty();) {
    const size_t nul = rest.find('\0');
    keep.emplace(rest.substr(0, nul));
    if (nul == std::string_view::npos) break;
    rest.remove_prefix(nul + 1);
  }
  return keep;
}

}  // namespace

std::optional<Answer> dispatch(ShardStore& s, const Command& c, std::string_view payload) {
  switch (c.op) {
    case Op::Open:
      return answer_status(c, s.open_staged(c.tx, c.shard, payload));
    case Op::Create: {
      const size_t nul = payload.find('\0');
      if (nul == std::string_view::npos) {
        return answer_error(c, make_error(EPROTO, "create: no transaction name"));
      }
      return answer_status(
          c, s.create(c.tx, payload.substr(nul + 1), c.shard, payload.substr(0, nul), c.offset));
    }
    case Op::Write:
      (void)s.write(c.tx, c.shard, c.offset, payload);  // latched: reported at the Sync
      return std::nullopt;
    case Op::Sync:
      return answer_status(c, s.sync(c.tx));
    case Op::Seal: {
      auto path = s.seal(c.tx, c.shard, payload);
      return path ? answer(c, 0, *path) : answer_error(c, path.error());
    }
    case Op::Read:
    case Op::ReadPath: {
      if (c.length > kMaxReadBytes) {
        return answer_error(c, make_error(EINVAL, "read of {} bytes: over the limit", c.length));
      }
      std::string data(static_cast<size_t>(c.length), '\0');
      auto st = c.op == Op::Read ? s.read(c.tx, c.shard, c.offset, data.data(), data.size())
                                 : s.read_path(payload, c.tx, c.offset, data.data(), data.size());
      return st ? answer(c, 0, data) : answer_error(c, st.error());
    }
    case Op::Close:
      s.close(c.tx);
      return std::nullopt;
    case Op::Abort:
      s.abort(c.tx);
      return answer(c, 0, {});
    case Op::Drop:
      return answer_status(c, s.drop(payload));
    case Op::Sweep: {
      auto n = s.sweep(split_names(payload));
      return n ? answer(c, 0, std::to_string(*n)) : answer_error(c, n.error());
    }
    case Op::Shutdown:
      return std::nullopt;  // the serve loop leaves before it gets here
  }
  return answer_error(c, make_error(EPROTO, "unknown command {}", static_cast<unsigned>(c.op)));
}

std::optional<Answer> refuse(const Command& c, const Error& why) {
  if (c.op == Op::Write || c.op == Op::Close || c.op == Op::Shutdown) return std::nullopt;
  return answer_error(c, why);
}

}  // namespace ckptfs::flush::mpi

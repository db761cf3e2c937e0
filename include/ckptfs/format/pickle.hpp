// A restricted unpickler: pickle bytes to a tree of inert values; nothing is executed, and only
// the globals and opcodes listed here are accepted.
//
// Torch writes pickles in two places a native checkpoint needs: DCP's `.metadata` (protocol 4)
// and the `data.pkl` of every `torch.save` archive (protocol 2). Both are untrusted input. This
// machine reads the opcode stream and builds values in an arena: a global is a name, and
// calling it (REDUCE, NEWOBJ) or setting its state (BUILD) makes a `Call` node recording what
// would have been called with what. Callers then read the fields they need from that tree.
//
// Caps: values, memo entries, marks and the references held by containers and the stack are
// bounded (Limits), and the input is held once (parse takes it by move): memory is linear in
// the caps, never in what a DUP or BINGET loop could make of the input. An integer past 64
// bits, an opcode or a global outside the lists, a memo index never stored (or past the next
// one: the memo is dense, as CPython's picklers write it), or a stream that
// does not end in STOP refuses the whole pickle, naming `what`, the offset and the opcode or
// global. The tree may hold cycles (a list appended to itself through the memo), so nothing
// walks it recursively: `Walk` reads one level per call, and its callers follow a fixed schema.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format::pickle {

using Ref = uint32_t;  // index of a value in its Pickle's arena

enum class Kind : uint8_t {
  None,
  Bool,
  Int,
  Float,
  Str,    // text as written (Walk::text refuses one that is not valid UTF-8)
  Bytes,  // binary strings
  Tuple,
  List,
  Dict,          // items: key, value, key, value, ...
  Global,        // s: module, name: attribute
  Call,          // func(args): REDUCE, or NEWOBJ (cls.__new__(cls, *args)); BUILD adds state
  PersistentId,  // BINPERSID: args is the id the pickler gave (torch: ('storage', ...))
};

// One value; 64 bytes, so the arena's worst case (Limits::max_values) stays bounded. Text is a
// slice of the pickle's own copy of its input (Pickle::text).
struct Value {
  enum class Added : uint8_t { Nothing, Elements, Pairs };

  Kind kind = Kind::None;
  // Call: items appended (APPEND/APPENDS: elements) or set (SETITEM/SETITEMS: pairs) on the
  // result, as an OrderedDict's or a list subclass's reduce does; never both.
  Added added = Added::Nothing;
  bool newobj = false;          // Call: made by NEWOBJ
  bool has_state = false;       // Call: BUILD gave it `state`
  Ref func = 0;                 // Call: the Global called
  Ref args = 0;                 // Call: the argument tuple; PersistentId: the id
  Ref state = 0;                // Call: the state BUILD gave it
  int64_t i = 0;                // Bool, Int; Float: the double's bits
  uint32_t off = 0, len = 0;    // Str, Bytes: the text; Global: the module
  uint32_t off2 = 0, len2 = 0;  // Global: the attribute name
  std::vector<Ref> items;  // Tuple, List: elements; Dict: key, value pairs; Call: what was added

  [[nodiscard]] double as_double() const;
};

struct GlobalName {
  std::string_view module;
  std::string_view name;
};

struct Limits {
  size_t max_values = size_t{1} << 22;  // arena entries (each opcode makes at most one)
  // Memo entries (4 bytes each: indices are dense, as CPython numbers them). torch memoizes 16
  // per DCP chunk: this is ~260k chunks, past where max_values binds (~175k).
  size_t max_memo = size_t{1} << 22;
  size_t max_marks = 4096;             // MARKs open at once
  size_t max_bytes = size_t{1} << 30;  // the input (text offsets are 32-bit)
  // References held at once by every container's items and the stack together (4 bytes each):
  // a DUP or BINGET pushes one per input byte and APPENDS keeps them, so without this a
  // 240 MiB input could hold 240 Mi of them (1.5 GB measured). torch's own .metadata
  // pickles hold 1.17 per value (per chunk: 24 values, 28 references, 16 memo entries, 142
  // bytes; measured on a 60,000-chunk one), so this cap binds only past ~600k chunks, after
  // max_values (~175k) does: it never refuses a real file the other caps pass. 64 MiB.
  size_t max_refs = size_t{1} << 24;
};

class Pickle {
 public:
  [[nodiscard]] const Value& at(Ref r) const { return values_.at(r); }
  [[nodiscard]] Ref root() const { return root_; }
  [[nodiscard]] size_t size() const { return values_.size(); }
  // References held in containers' items (the stack's last one, the root, is not counted).
  [[nodiscard]] size_t refs() const { return refs_; }
  // The input, held once: every text is a slice of it.
  [[nodiscard]] std::string_view input() const { return bytes_; }
  // Str, Bytes: the text; Global: the module.
  [[nodiscard]] std::string_view text(const Value& v) const { return slice(v.off, v.len); }
  // Global: the attribute name.
  [[nodiscard]] std::string_view name(const Value& v) const { return slice(v.off2, v.len2); }

 private:
  friend class Machine;
  [[nodiscard]] std::string_view slice(uint32_t off, uint32_t len) const {
    return std::string_view(bytes_).substr(off, len);
  }
  std::string bytes_;  // the input, moved in by parse: every text is a slice of it
  std::vector<Value> values_;
  size_t refs_ = 0;  // sum of every value's items.size()
  Ref root_ = 0;
};

// Parse `bytes` (a whole pickle, protocol 2 to 5) allowing only `allowed` globals. `what`
// names the input in every message ("ckpt/.metadata", "ckpt/__0_0.distcp chunk 'w'"). The
// Pickle keeps the input it was given: moved in, never copied.
Result<Pickle> parse(std::string&& bytes, std::span<const GlobalName> allowed,
                     std::string_view what, const Limits& limits = {});
// The same on a copy of `bytes` (after the size check): for inputs the caller keeps.
Result<Pickle> parse(std::string_view bytes, std::span<const GlobalName> allowed,
                     std::string_view what, const Limits& limits = {});

// Typed reads of a parsed tree, each bounded in depth, failing with a message that says what
// was expected where. `where` is a path for the message ("storage_data[3].offset").
class Walk {
 public:
  Walk(const Pickle& p, std::string_view what) : p_(p), what_(what) {}

  [[nodiscard]] const Value& at(Ref r) const { return p_.at(r); }
  [[nodiscard]] bool is_global(Ref r, std::string_view module, std::string_view name) const;
  // A Call of the global module.name (REDUCE or NEWOBJ); its Value.
  Result<const Value*> call(Ref r, std::string_view module, std::string_view name,
                            std::string_view where) const;
  Result<int64_t> integer(Ref r, std::string_view where) const;
  Result<uint64_t> non_negative(Ref r, std::string_view where) const;
  // A Str, which must be valid UTF-8 (Python's unpickler decodes it as such, and the names
  // and paths read from it end up in JSON headers).
  Result<std::string_view> text(Ref r, std::string_view where) const;
  // Elements of a Tuple or List.
  Result<std::span<const Ref>> sequence(Ref r, std::string_view where) const;
  // A tuple/list of non-negative integers, or a torch.Size(tuple) call.
  Result<std::vector<uint64_t>> dims(Ref r, std::string_view where) const;
  // The (key, value) pairs of a Dict, or of a Call that received SETITEMS (OrderedDict).
  Result<std::span<const Ref>> pairs(Ref r, std::string_view where) const;
  // The state BUILD gave a Call of module.name, as (attribute, value) pairs of its dict
  // (a (None, dict) slots state is read as its dict too).
  Result<std::span<const Ref>> object_state(Ref r, std::string_view module, std::string_view name,
                                            std::string_view where) const;
  // In a pairs span, the value of the Str key `key`, if present.
  [[nodiscard]] std::optional<Ref> field(std::span<const Ref> pairs, std::string_view key) const;

  [[nodiscard]] Error fail(std::string_view where, std::string_view expected, Ref got) const;
  [[nodiscard]] std::string describe(Ref r) const;

 private:
  const Pickle& p_;
  std::string_view what_;
};

}  // namespace ckptfs::format::pickle

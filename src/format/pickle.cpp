// The restricted unpickler: an opcode machine that builds inert values and executes nothing.
#include "ckptfs/format/pickle.hpp"

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "ckptfs/util/text.hpp"

namespace ckptfs::format::pickle {

double Value::as_double() const { return std::bit_cast<double>(i); }

namespace {

// Values every pickle shares, made once at the front of the arena (they are immutable, so an
// opcode that makes one allocates nothing).
constexpr Ref kNone = 0, kTrue = 1, kFalse = 2, kEmptyTuple = 3;

Value make(Kind kind, int64_t i = 0) {
  Value v;
  v.kind = kind;
  v.i = i;
  return v;
}
Value text_value(Kind kind, uint64_t off, uint64_t len) {
  Value v = make(kind);
  v.off = static_cast<uint32_t>(off);
  v.len = static_cast<uint32_t>(len);
  return v;
}

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return "a bool";
    case Kind::Int:
      return "an int";
    case Kind::Float:
      return "a float";
    case Kind::Str:
      return "a str";
    case Kind::Bytes:
      return "bytes";
    case Kind::Tuple:
      return "a tuple";
    case Kind::List:
      return "a list";
    case Kind::Dict:
      return "a dict";
    case Kind::Global:
      return "a global";
    case Kind::Call:
      return "an object";
    case Kind::PersistentId:
      return "a persistent id";
  }
  return "?";
}

// Printable name of an opcode byte for messages: its character where it has one.
std::string op_name(uint8_t op) {
  if (op >= 0x20 && op < 0x7f) return fmt::format("'{}' (0x{:02x})", static_cast<char>(op), op);
  return fmt::format("0x{:02x}", op);
}

}  // namespace

// The opcode machine. Each opcode either pushes one value (allocating at most one arena
// entry), or consumes stack entries into a container already on it.
class Machine {
 public:
  Machine(std::string&& bytes, std::span<const GlobalName> allowed, std::string_view what,
          const Limits& limits)
      : allowed_(allowed), what_(what), limits_(limits) {
    p_.bytes_ = std::move(bytes);  // held once: the caller's buffer, not a copy of it
    p_.values_.reserve(64);
    p_.values_.push_back(make(Kind::None));     // kNone
    p_.values_.push_back(make(Kind::Bool, 1));  // kTrue
    p_.values_.push_back(make(Kind::Bool, 0));  // kFalse
    p_.values_.push_back(make(Kind::Tuple));    // kEmptyTuple
  }

  Result<Pickle> run() {
    while (true) {
      if (pos_ >= p_.bytes_.size()) {
        return make_error(EINVAL, "{}: pickle ends at byte {} without STOP", what_, pos_);
      }
      op_at_ = pos_;
      op_ = static_cast<uint8_t>(p_.bytes_[pos_++]);
      if (op_ == '.') {  // STOP
        if (stack_.size() != 1 || !marks_.empty()) {
          return fail("STOP with {} values and {} marks on the stack (one value expected)",
                      stack_.size(), marks_.size());
        }
        p_.root_ = stack_.back();
        return std::move(p_);
      }
      CKPTFS_CHECK(step());
    }
  }

 private:
  template <typename... Args>
  Error fail(fmt::format_string<Args...> f, Args&&... args) const {
    return make_error(EINVAL, "{}: pickle opcode {} at byte {}: {}", what_, op_name(op_), op_at_,
                      fmt::format(f, std::forward<Args>(args)...));
  }

  Status step() {
    switch (op_) {
      case 0x80: {  // PROTO
        CKPTFS_TRY(uint64_t v, uint_le(1));
        if (v < 2 || v > 5) return fail("protocol {} (2 to 5 are read)", v);
        return {};
      }
      case 0x95: {  // FRAME: a length hint only
        CKPTFS_TRY(uint64_t n, uint_le(8));
        (void)n;
        return {};
      }
      case '(':  // MARK
        if (marks_.size() >= limits_.max_marks)
          return fail("more than {} marks", limits_.max_marks);
        marks_.push_back(stack_.size());
        return {};
      case '0':  // POP: the top value, or a mark on top
        if (!stack_.empty() && (marks_.empty() || marks_.back() < stack_.size())) {
          stack_.pop_back();
          return {};
        }
        return pop_mark().ok() ? Status{} : Status{fail("nothing to pop")};
      case '1': {  // POP_MARK
        CKPTFS_TRY(auto from, pop_mark());
        stack_.resize(from);
        return {};
      }
      case '2': {  // DUP
        CKPTFS_TRY(Ref top, peek());
        return push(top);
      }
      case 'N':
        return push(kNone);
      case 0x88:
        return push(kTrue);
      case 0x89:
        return push(kFalse);
      case 'J': {  // BININT: signed 32-bit
        CKPTFS_TRY(uint64_t v, uint_le(4));
        return push_int(static_cast<int32_t>(static_cast<uint32_t>(v)));
      }
      case 'K': {  // BININT1
        CKPTFS_TRY(uint64_t v, uint_le(1));
        return push_int(static_cast<int64_t>(v));
      }
      case 'M': {  // BININT2
        CKPTFS_TRY(uint64_t v, uint_le(2));
        return push_int(static_cast<int64_t>(v));
      }
      case 0x8a: {  // LONG1
        CKPTFS_TRY(uint64_t n, uint_le(1));
        return long_bytes(n);
      }
      case 0x8b: {  // LONG4
        CKPTFS_TRY(uint64_t n, uint_le(4));
        return long_bytes(n);
      }
      case 'G': {  // BINFLOAT: big-endian double
        CKPTFS_TRY(std::string_view b, take(8));
        uint64_t bits = 0;
        for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
        return push_new(make(Kind::Float, static_cast<int64_t>(bits)));
      }
      case 0x8c:
        return text(Kind::Str, 1);  // SHORT_BINUNICODE
      case 'X':
        return text(Kind::Str, 4);  // BINUNICODE
      case 0x8d:
        return text(Kind::Str, 8);  // BINUNICODE8
      case 'U':
        return text(Kind::Str, 1);  // SHORT_BINSTRING (Python 3 reads it as str)
      case 'T':
        return text(Kind::Str, 4);  // BINSTRING
      case 'C':
        return text(Kind::Bytes, 1);  // SHORT_BINBYTES
      case 'B':
        return text(Kind::Bytes, 4);  // BINBYTES
      case 0x8e:
        return text(Kind::Bytes, 8);  // BINBYTES8
      case ')':
        return push(kEmptyTuple);
      case 't': {  // TUPLE
        CKPTFS_TRY(auto from, pop_mark());
        return collect(Kind::Tuple, from);
      }
      case 0x85:
        return tuple_of(1);
      case 0x86:
        return tuple_of(2);
      case 0x87:
        return tuple_of(3);
      case ']':
        return push_new(make(Kind::List));
      case 'l': {  // LIST
        CKPTFS_TRY(auto from, pop_mark());
        return collect(Kind::List, from);
      }
      case '}':
        return push_new(make(Kind::Dict));
      case 'd': {  // DICT
        CKPTFS_TRY(auto from, pop_mark());
        if ((stack_.size() - from) % 2 != 0) return fail("odd number of keys and values");
        return collect(Kind::Dict, from);
      }
      case 'a':
        return add_items(/*pairs=*/false, /*marked=*/false);  // APPEND
      case 'e':
        return add_items(false, true);  // APPENDS
      case 's':
        return add_items(true, false);  // SETITEM
      case 'u':
        return add_items(true, true);  // SETITEMS
      case 'c':
        return global_line();  // GLOBAL
      case 0x93:
        return stack_global();  // STACK_GLOBAL
      case 'R':
        return call(false);  // REDUCE
      case 0x81:
        return call(true);  // NEWOBJ
      case 'b':
        return build();  // BUILD
      case 'Q': {        // BINPERSID
        CKPTFS_TRY(Ref id, pop());
        Value v = make(Kind::PersistentId);
        v.args = id;
        return push_new(std::move(v));
      }
      case 'q': {  // BINPUT
        CKPTFS_TRY(uint64_t i, uint_le(1));
        return put(i);
      }
      case 'r': {  // LONG_BINPUT
        CKPTFS_TRY(uint64_t i, uint_le(4));
        return put(i);
      }
      case 0x94:
        return put(memo_.size());  // MEMOIZE
      case 'h': {                  // BINGET
        CKPTFS_TRY(uint64_t i, uint_le(1));
        return get(i);
      }
      case 'j': {  // LONG_BINGET
        CKPTFS_TRY(uint64_t i, uint_le(4));
        return get(i);
      }
      default:
        return fail("is not an opcode this reader allows");
    }
  }

  Result<std::string_view> take(uint64_t n) {
    if (n > p_.bytes_.size() - pos_) {
      return fail("needs {} bytes, {} are left", n, p_.bytes_.size() - pos_);
    }
    std::string_view out = std::string_view(p_.bytes_).substr(pos_, n);
    pos_ += n;
    return out;
  }
  Result<uint64_t> uint_le(int n) {
    CKPTFS_TRY(std::string_view b, take(static_cast<uint64_t>(n)));
    uint64_t v = 0;
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<uint8_t>(b[static_cast<size_t>(k)]);
    return v;
  }

  Status push(Ref r) {
    // Every reference held is pushed here first (containers take theirs from the stack), so
    // this one check bounds them all: a DUP or BINGET loop makes one per input byte, and
    // APPENDS keeps them in a list.
    if (stack_.size() >= limits_.max_values)
      return fail("more than {} values on the stack", limits_.max_values);
    if (stack_.size() + p_.refs_ >= limits_.max_refs) {
      return fail("more than {} references held by containers and the stack (max_refs)",
                  limits_.max_refs);
    }
    stack_.push_back(r);
    return {};
  }
  Status push_new(Value v) {
    if (p_.values_.size() >= limits_.max_values) {
      return fail("more than {} values", limits_.max_values);
    }
    p_.values_.push_back(std::move(v));
    return push(static_cast<Ref>(p_.values_.size() - 1));
  }
  Status push_int(int64_t v) { return push_new(make(Kind::Int, v)); }

  Result<Ref> peek() const {
    if (stack_.empty() || (!marks_.empty() && marks_.back() == stack_.size())) {
      return fail("the stack is empty");
    }
    return stack_.back();
  }
  Result<Ref> pop() {
    CKPTFS_TRY(Ref r, peek());
    stack_.pop_back();
    return r;
  }
  Result<size_t> pop_mark() {
    if (marks_.empty()) return fail("no mark to pop to");
    const size_t from = marks_.back();
    marks_.pop_back();
    return from;
  }

  Status long_bytes(uint64_t n) {
    if (n > 8) return fail("an integer of {} bytes (64 bits are read)", n);
    CKPTFS_TRY(std::string_view b, take(n));
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[k]);
    if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    return push_int(static_cast<int64_t>(v));
  }

  Status text(Kind kind, int len_bytes) {
    CKPTFS_TRY(uint64_t n, uint_le(len_bytes));
    if (op_ == 'T' && n > INT32_MAX) return fail("negative string length");
    const uint64_t at = pos_;
    CKPTFS_TRY(std::string_view b, take(n));
    (void)b;
    return push_new(text_value(kind, at, n));
  }

  Status collect(Kind kind, size_t from) {
    Value v = make(kind);
    v.items.assign(stack_.begin() + static_cast<ptrdiff_t>(from), stack_.end());
    p_.refs_ += v.items.size();  // moved from the stack: the total held does not grow
    stack_.resize(from);
    if (kind == Kind::Tuple && v.items.empty()) return push(kEmptyTuple);
    return push_new(std::move(v));
  }
  Status tuple_of(size_t n) {
    const size_t floor = marks_.empty() ? 0 : marks_.back();
    if (stack_.size() - floor < n) return fail("a tuple of {} needs {} values on the stack", n, n);
    return collect(Kind::Tuple, stack_.size() - n);
  }

  // APPEND/APPENDS/SETITEM/SETITEMS onto the list, dict or object below the new items.
  Status add_items(bool pairs, bool marked) {
    size_t from;
    if (marked) {
      CKPTFS_TRY(auto m, pop_mark());
      from = m;
    } else {
      const size_t floor = marks_.empty() ? 0 : marks_.back();
      const size_t n = pairs ? 2 : 1;
      if (stack_.size() - floor < n + 1) return fail("not enough values on the stack");
      from = stack_.size() - n;
    }
    // The container is the top of the frame the items were added in (after a marked
    // opcode, the enclosing one): never a value below another open MARK.
    if (from == 0 || (!marks_.empty() && from - 1 < marks_.back())) {
      return fail("no container below the items");
    }
    if (pairs && (stack_.size() - from) % 2 != 0) return fail("odd number of keys and values");
    Value& target = p_.values_[stack_[from - 1]];
    const auto want = pairs ? Value::Added::Pairs : Value::Added::Elements;
    const bool fits = target.kind == (pairs ? Kind::Dict : Kind::List) ||
                      (target.kind == Kind::Call &&
                       (target.added == Value::Added::Nothing || target.added == want));
    if (!fits) {
      return fail("{} into {}", pairs ? "setting items" : "appending", kind_name(target.kind));
    }
    if (target.kind == Kind::Call) target.added = want;
    target.items.insert(target.items.end(), stack_.begin() + static_cast<ptrdiff_t>(from),
                        stack_.end());
    p_.refs_ += stack_.size() - from;  // moved from the stack: the total held does not grow
    stack_.resize(from);
    return {};
  }

  Status resolve(std::string_view module, std::string_view name, uint32_t moff, uint32_t noff) {
    const bool listed = std::any_of(allowed_.begin(), allowed_.end(), [&](const GlobalName& g) {
      return g.module == module && g.name == name;
    });
    if (!listed) {
      return make_error(EINVAL, "{}: pickle global {}.{} (byte {}) is not one this reader allows",
                        what_, module.substr(0, 200), name.substr(0, 200), op_at_);
    }
    Value v = text_value(Kind::Global, moff, module.size());
    v.off2 = noff;
    v.len2 = static_cast<uint32_t>(name.size());
    return push_new(std::move(v));
  }
  Status global_line() {
    auto line = [&]() -> Result<std::pair<uint32_t, std::string_view>> {
      const size_t nl = p_.bytes_.find('\n', pos_);
      if (nl == std::string::npos || nl - pos_ > 1024) return fail("a name line without an end");
      const auto at = static_cast<uint32_t>(pos_);
      std::string_view s = std::string_view(p_.bytes_).substr(pos_, nl - pos_);
      pos_ = nl + 1;
      return std::pair{at, s};
    };
    CKPTFS_TRY(auto module, line());
    CKPTFS_TRY(auto name, line());
    return resolve(module.second, name.second, module.first, name.first);
  }
  Status stack_global() {
    CKPTFS_TRY(Ref name, pop());
    CKPTFS_TRY(Ref module, pop());
    const Value& n = p_.values_[name];
    const Value& m = p_.values_[module];
    if (n.kind != Kind::Str || m.kind != Kind::Str) return fail("module and name are not both str");
    return resolve(p_.text(m), p_.text(n), m.off, n.off);
  }

  Status call(bool newobj) {
    CKPTFS_TRY(Ref args, pop());
    CKPTFS_TRY(Ref func, pop());
    if (p_.values_[func].kind != Kind::Global) {
      return fail("calls {}, not a global", kind_name(p_.values_[func].kind));
    }
    if (p_.values_[args].kind != Kind::Tuple) {
      return fail("arguments are {}, not a tuple", kind_name(p_.values_[args].kind));
    }
    Value v = make(Kind::Call);
    v.newobj = newobj;
    v.func = func;
    v.args = args;
    return push_new(std::move(v));
  }
  Status build() {
    CKPTFS_TRY(Ref state, pop());
    CKPTFS_TRY(Ref target, peek());
    Value& t = p_.values_[target];
    if (t.kind != Kind::Call) return fail("sets the state of {}", kind_name(t.kind));
    if (t.has_state) return fail("sets an object's state twice");
    t.has_state = true;
    t.state = state;
    return {};
  }

  // CPython's picklers (and so torch.save and dcp.save) number memo entries in order: a PUT
  // names the next index (len(memo)), MEMOIZE implies it. So the memo is a dense array of 4
  // bytes an entry; an index past the next one is refused, one already stored is replaced.
  Status put(uint64_t i) {
    CKPTFS_TRY(Ref top, peek());
    if (i < memo_.size()) {
      memo_[i] = top;
      return {};
    }
    if (i > memo_.size()) {
      return fail("memo index {} skips ahead (the next is {})", i, memo_.size());
    }
    if (memo_.size() >= limits_.max_memo) {
      return fail("more than {} memo entries", limits_.max_memo);
    }
    memo_.push_back(top);
    return {};
  }
  Status get(uint64_t i) {
    if (i >= memo_.size()) return fail("memo index {} was never stored", i);
    return push(memo_[i]);
  }

  Pickle p_;
  std::span<const GlobalName> allowed_;
  std::string_view what_;
  const Limits& limits_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  uint8_t op_ = 0;
  std::vector<Ref> stack_;
  std::vector<size_t> marks_;  // stack heights at each open MARK
  std::vector<Ref> memo_;      // dense: entry i is the value PUT i stored
};

namespace {
Status check_size(size_t size, std::string_view what, const Limits& limits) {
  if (size > limits.max_bytes) {
    return make_error(EFBIG, "{}: pickle of {} bytes is over the {}-byte limit", what, size,
                      limits.max_bytes);
  }
  return {};
}
}  // namespace

Result<Pickle> parse(std::string&& bytes, std::span<const GlobalName> allowed,
                     std::string_view what, const Limits& limits) {
  CKPTFS_CHECK(check_size(bytes.size(), what, limits));
  return Machine(std::move(bytes), allowed, what, limits).run();
}

Result<Pickle> parse(std::string_view bytes, std::span<const GlobalName> allowed,
                     std::string_view what, const Limits& limits) {
  CKPTFS_CHECK(check_size(bytes.size(), what, limits));
  return Machine(std::string(bytes), allowed, what, limits).run();
}

// ---- Walk ------------------------------------------------------------------------------------

std::string Walk::describe(Ref r) const {
  const Value& v = p_.at(r);
  switch (v.kind) {
    case Kind::Int:
      return fmt::format("the int {}", v.i);
    case Kind::Str:
      return fmt::format("the str '{}'", printable(p_.text(v).substr(0, 40)));
    case Kind::Global:
      return fmt::format("the global {}.{}", p_.text(v), p_.name(v));
    case Kind::Call: {
      const Value& f = p_.at(v.func);
      return fmt::format("a {}.{} object", p_.text(f), p_.name(f));
    }
    default:
      return std::string(kind_name(v.kind));
  }
}

Error Walk::fail(std::string_view where, std::string_view expected, Ref got) const {
  return make_error(EINVAL, "{}: {} is {}, not {}", what_, where, describe(got), expected);
}

bool Walk::is_global(Ref r, std::string_view module, std::string_view name) const {
  const Value& v = p_.at(r);
  return v.kind == Kind::Global && p_.text(v) == module && p_.name(v) == name;
}

Result<const Value*> Walk::call(Ref r, std::string_view module, std::string_view name,
                                std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind != Kind::Call || !is_global(v.func, module, name)) {
    return fail(where, fmt::format("a {}.{} object", module, name), r);
  }
  return &v;
}

Result<int64_t> Walk::integer(Ref r, std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind != Kind::Int) return fail(where, "an int", r);
  return v.i;
}

Result<uint64_t> Walk::non_negative(Ref r, std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind != Kind::Int || v.i < 0) return fail(where, "a non-negative int", r);
  return static_cast<uint64_t>(v.i);
}

Result<std::string_view> Walk::text(Ref r, std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind != Kind::Str) return fail(where, "a str", r);
  const std::string_view s = p_.text(v);
  if (!is_valid_utf8(s)) {
    // Python's unpickler decodes a str as UTF-8 (passing surrogates only) and fails on such
    // bytes: torch never wrote them, and a name made of them cannot go into a JSON header.
    return make_error(EINVAL, "{}: {} is a str that is not valid UTF-8 ('{}')", what_, where,
                      printable(s.substr(0, 200)));
  }
  return s;
}

Result<std::span<const Ref>> Walk::sequence(Ref r, std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind != Kind::Tuple && v.kind != Kind::List) return fail(where, "a tuple or list", r);
  return std::span<const Ref>(v.items);
}

Result<std::vector<uint64_t>> Walk::dims(Ref r, std::string_view where) const {
  Ref seq = r;
  const Value& v = p_.at(r);
  if (v.kind == Kind::Call && is_global(v.func, "torch", "Size")) {
    const Value& args = p_.at(v.args);
    if (args.items.size() != 1) return fail(where, "torch.Size(tuple)", r);
    seq = args.items[0];
  }
  CKPTFS_TRY(auto items, sequence(seq, where));
  std::vector<uint64_t> out;
  out.reserve(items.size());
  for (Ref item : items) {
    CKPTFS_TRY(uint64_t d, non_negative(item, where));
    out.push_back(d);
  }
  return out;
}

Result<std::span<const Ref>> Walk::pairs(Ref r, std::string_view where) const {
  const Value& v = p_.at(r);
  if (v.kind == Kind::Dict) return std::span<const Ref>(v.items);
  if (v.kind == Kind::Call && v.added != Value::Added::Elements) {
    return std::span<const Ref>(v.items);
  }
  return fail(where, "a dict", r);
}

Result<std::span<const Ref>> Walk::object_state(Ref r, std::string_view module,
                                                std::string_view name,
                                                std::string_view where) const {
  CKPTFS_TRY(const Value* v, call(r, module, name, where));
  if (!v->has_state) return fail(where, fmt::format("a {}.{} with its state", module, name), r);
  Ref state = v->state;
  // A dataclass with __slots__ pickles its state as (None, {slot: value}).
  const Value& s = p_.at(state);
  if (s.kind == Kind::Tuple && s.items.size() == 2 && p_.at(s.items[0]).kind == Kind::None) {
    state = s.items[1];
  }
  return pairs(state, where);
}

std::optional<Ref> Walk::field(std::span<const Ref> pairs, std::string_view key) const {
  for (size_t k = 0; k + 1 < pairs.size(); k += 2) {
    const Value& v = p_.at(pairs[k]);
    if (v.kind == Kind::Str && p_.text(v) == key) return pairs[k + 1];
  }
  return std::nullopt;
}

}  // namespace ckptfs::format::pickle

// cli/args: the command-line parser every subcommand shares.
#include "ckptfs/cli/args.hpp"

#include <charconv>

#include <fmt/core.h>

namespace ckptfs::cli {

std::optional<std::string> Args::get(std::string_view name) const {
  auto it = opts.find(std::string(name));
  if (it == opts.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

std::vector<std::string> Args::all(std::string_view name) const {
  auto it = opts.find(std::string(name));
  return it == opts.end() ? std::vector<std::string>{} : it->second;
}

Result<Args> parse_args(std::span<char*> argv, std::span<const OptSpec> spec,
                        std::string_view cmd) {
  Args out;
  auto find_long = [&](std::string_view n) -> const OptSpec* {
    for (const auto& s : spec) {
      if (s.name == n) return &s;
    }
    return nullptr;
  };
  auto find_short = [&](char c) -> const OptSpec* {
    for (const auto& s : spec) {
      if (s.short_name == c) return &s;
    }
    return nullptr;
  };
  bool only_positional = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    std::string_view a = argv[i];
    if (only_positional || a.size() < 2 || a[0] != '-') {
      out.positional.emplace_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "--help" || a == "-h") {
      out.opts["help"].emplace_back();
      continue;
    }
    const OptSpec* s = nullptr;
    std::optional<std::string> inline_value;
    if (a.starts_with("--")) {
      std::string_view body = a.substr(2);
      auto eq = body.find('=');
      if (eq != std::string_view::npos) {
        inline_value = std::string(body.substr(eq + 1));
        body = body.substr(0, eq);
      }
      s = find_long(body);
    } else if (a.size() >= 2) {
      s = find_short(a[1]);
      if (s && a.size() > 2) inline_value = std::string(a.substr(2));
    }
    if (!s) {
      return make_error(EINVAL, "ckptfs {}: unknown option '{}' (see 'ckptfs {} --help')", cmd, a,
                        cmd);
    }
    if (!s->takes_value) {
      if (inline_value) {
        return make_error(EINVAL, "ckptfs {}: option '--{}' takes no value", cmd, s->name);
      }
      out.opts[std::string(s->name)].emplace_back();
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argv.size()) {
        return make_error(EINVAL, "ckptfs {}: option '--{}' needs a value", cmd, s->name);
      }
      inline_value = std::string(argv[++i]);
    }
    out.opts[std::string(s->name)].push_back(*inline_value);
  }
  return out;
}

std::variant<Args, int> parse_command(std::span<char*> argv, std::span<const OptSpec> spec,
                                      const CommandSpec& cmd) {
  auto args = parse_args(argv, spec, cmd.name);
  if (!args) {
    fmt::print(stderr, "{}\n", args.error().message);
    return 2;
  }
  if (args->has("help")) {
    fmt::print("{}", cmd.usage);
    return 0;
  }
  if (args->positional.size() != cmd.count) {
    fmt::print(stderr, "ckptfs {}: expected {}\n{}", cmd.name, cmd.positional, cmd.usage);
    return 2;
  }
  return std::move(args).value();
}

Result<unsigned> parse_unsigned(std::string_view text, std::string_view what) {
  unsigned v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size()) {
    return make_error(EINVAL, "{}: '{}' is not a non-negative integer", what, text);
  }
  return v;
}

}  // namespace ckptfs::cli

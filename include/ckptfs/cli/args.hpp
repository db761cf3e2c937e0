// Minimal command-line parsing shared by the subcommands.
#pragma once

#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::cli {

struct OptSpec {
  std::string_view name;  // long name without dashes, e.g. "threads"
  char short_name = 0;    // e.g. 'f'; 0 for none
  bool takes_value = false;
};

struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> opts;  // long name -> values (flags: "")

  [[nodiscard]] bool has(std::string_view name) const { return opts.count(std::string(name)) > 0; }
  [[nodiscard]] std::optional<std::string> get(std::string_view name) const;
  [[nodiscard]] std::vector<std::string> all(std::string_view name) const;
};

// Parses argv (without the program and subcommand). "--help"/"-h" is always accepted.
// Unknown options are an error naming the option and the command.
Result<Args> parse_args(std::span<char*> argv, std::span<const OptSpec> spec, std::string_view cmd);

// The common front of every subcommand: parses argv, answers --help (exit 0), refuses
// unknown options or a wrong number of positional arguments (exit 2). Returns the parsed
// arguments, or the exit status to return right away.
struct CommandSpec {
  std::string_view name;        // "inspect"
  std::string_view usage;       // full --help text
  std::string_view positional;  // "DIR", "SRC and DST": used in the error
  size_t count = 0;             // required positional arguments
};
std::variant<Args, int> parse_command(std::span<char*> argv, std::span<const OptSpec> spec,
                                      const CommandSpec& cmd);

Result<unsigned> parse_unsigned(std::string_view text, std::string_view what);

// Subcommands. Each returns the process exit status.
int cmd_inspect(std::span<char*> argv);
int cmd_verify(std::span<char*> argv);
int cmd_consolidate(std::span<char*> argv);
int cmd_mount(std::span<char*> argv, bool mount_helper_form);
int cmd_status(std::span<char*> argv);
int cmd_version(std::span<char*> argv);
int cmd_load(std::span<char*> argv);

// What `ckptfs --version` prints.
std::string version_text();

}  // namespace ckptfs::cli

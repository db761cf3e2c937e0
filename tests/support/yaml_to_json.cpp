// yaml_to_json: reads YAML documents on stdin, separated by NUL bytes, through format/yaml, and
// prints one line for each: the JSON it gives, or "error: " and the message. For
// tests/python/test_yaml_pyyaml.py, which compares it with PyYAML's safe_load of what
// safe_dump writes.
#include <iostream>
#include <iterator>
#include <string>
#include <string_view>

#include "ckptfs/format/yaml.hpp"

int main() {
  const std::string all((std::istreambuf_iterator<char>(std::cin)),
                        std::istreambuf_iterator<char>());
  for (size_t b = 0; b <= all.size();) {
    size_t e = all.find('\0', b);
    if (e == std::string::npos) e = all.size();
    auto r = ckptfs::format::parse_yaml(std::string_view(all).substr(b, e - b), "stdin");
    if (r) {
      std::cout << r->dump() << "\n";
    } else {
      std::cout << "error: " << r.error().message << "\n";
    }
    b = e + 1;
  }
  return 0;
}

// fs/node_table: the inode table, the inode number allocator and the names the kernel may cache.
#include "node_table.hpp"

#include <algorithm>
#include <cstdlib>

#include <spdlog/spdlog.h>

#include "dir_views.hpp"

namespace ckptfs::fs {
namespace {

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

Kind kind_of(mode_t m) {
  if (S_ISDIR(m)) return Kind::Dir;
  if (S_ISREG(m)) return Kind::File;
  if (S_ISLNK(m)) return Kind::Symlink;
  return Kind::Other;
}

Key real_key(const struct stat& st) {
  return Key{Space::Real,
             static_cast<uint32_t>(st.st_mode & S_IFMT),
             static_cast<uint64_t>(st.st_dev),
             static_cast<uint64_t>(st.st_ino),
             0,
             {}};
}

uint64_t virtual_ino(uint64_t dev, uint64_t ino, uint64_t gen, std::string_view name) {
  uint64_t h = mix64(dev ^ mix64(ino ^ mix64(gen)));
  for (unsigned char c : name) h = mix64(h ^ c);
  return h | (1ull << 63);
}

void NodeTable::set_root(Node root) {
  root_dev_ = root.dev;
  std::lock_guard lock(mu_);
  keys_.emplace(root.key, kRootIno);
  nodes_.emplace(kRootIno, std::make_shared<Node>(std::move(root)));
}

uint64_t NodeTable::shown_ino(uint64_t dev, uint64_t ino) const {
  if (dev == root_dev_) return ino;
  return (mix64(dev * 0x9e3779b97f4a7c15ull ^ ino) & ~(3ull << 62)) | (1ull << 62);
}

std::optional<Node> NodeTable::get(Ino ino) const {
  std::lock_guard lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return std::nullopt;
  return *it->second;
}

Node NodeTable::remember(const Key& key, Node proto, Ino parent, std::string_view name) {
  std::lock_guard lock(mu_);
  auto [it, inserted] = keys_.emplace(key, 0);
  if (inserted) it->second = next_ino_++;
  auto& slot = nodes_[it->second];
  if (!slot) {
    proto.ino = it->second;
    proto.key = key;
    slot = std::make_shared<Node>(std::move(proto));
  } else {
    slot->rel = proto.rel;  // the inode (or its directory) may have moved within the source
  }
  slot->nlookup++;
  std::pair<Ino, std::string> link{parent, std::string(name)};
  if (std::find(slot->links.begin(), slot->links.end(), link) == slot->links.end()) {
    slot->links.push_back(link);
  }
  kids_[std::move(link)] = slot->ino;
  return *slot;
}

std::shared_ptr<DirState> NodeTable::forget(Ino ino, uint64_t n) {
  std::lock_guard lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end() || ino == kRootIno) return nullptr;
  auto& node = *it->second;
  if (n > node.nlookup) {
    spdlog::critical("forget({}, {}) with only {} lookups", ino, n, node.nlookup);
    std::abort();
  }
  node.nlookup -= n;
  if (node.nlookup > 0) return nullptr;
  // The kernel holds nothing of it any more: retire its number, its names and, for a
  // directory, its cached view (rebuilt from the header cache if it is looked up again).
  keys_.erase(node.key);
  for (const auto& link : node.links) {
    if (auto k = kids_.find(link); k != kids_.end() && k->second == ino) kids_.erase(k);
  }
  std::shared_ptr<DirState> dropped;
  if (node.kind == Kind::Dir) {
    if (auto d = dirs_.find({node.dev, node.bino}); d != dirs_.end()) {
      dropped = std::move(d->second);
      dirs_.erase(d);
    }
  }
  nodes_.erase(it);
  return dropped;
}

bool NodeTable::swap_cached_stamp(Ino ino, const layout::FileStamp& stamp) {
  std::lock_guard lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end()) return false;
  bool same = it->second->cached == stamp;
  it->second->cached = stamp;
  return same;
}

void NodeTable::set_rel(Ino ino, const std::string& rel) {
  std::lock_guard lock(mu_);
  if (auto it = nodes_.find(ino); it != nodes_.end()) it->second->rel = rel;
}

void NodeTable::renamed(Ino op, const std::string& oname, const std::string& old_rel, Ino np,
                        const std::string& nname, const std::string& new_rel, bool exchange) {
  std::lock_guard lock(mu_);
  auto move = [](std::string& rel, const std::string& from, const std::string& to) {
    if (rel == from) {
      rel = to;
      return true;
    }
    if (rel.size() > from.size() && rel.starts_with(from) && rel[from.size()] == '/') {
      rel = to + rel.substr(from.size());
      return true;
    }
    return false;
  };
  for (auto& [ino, node] : nodes_) {
    if (node->key.space == Space::Virtual) continue;  // follows its directory through the view
    if (move(node->rel, old_rel, new_rel)) continue;
    if (exchange) move(node->rel, new_rel, old_rel);
  }
  std::optional<Ino> a, b;
  if (auto it = kids_.find({op, oname}); it != kids_.end()) {
    a = it->second;
    kids_.erase(it);
  }
  if (auto it = kids_.find({np, nname}); it != kids_.end()) {
    b = it->second;
    kids_.erase(it);
  }
  auto relink = [&](Ino ino, std::pair<Ino, std::string> from, std::pair<Ino, std::string> to) {
    kids_[to] = ino;
    if (auto it = nodes_.find(ino); it != nodes_.end()) {
      auto& links = it->second->links;
      links.erase(std::remove(links.begin(), links.end(), from), links.end());
      links.push_back(to);
    }
  };
  if (a) relink(*a, {op, oname}, {np, nname});
  if (b && exchange) relink(*b, {np, nname}, {op, oname});
}

void NodeTable::put_back(Ino ino, Ino parent, const std::string& name, const std::string& rel) {
  std::lock_guard lock(mu_);
  auto it = nodes_.find(ino);
  if (it == nodes_.end() || it->second->retired) return;
  it->second->rel = rel;
  kids_[{parent, name}] = ino;
  auto& links = it->second->links;
  if (std::find(links.begin(), links.end(), std::pair<Ino, std::string>{parent, name}) ==
      links.end()) {
    links.emplace_back(parent, name);
  }
}

void NodeTable::retire_locked(Ino ino) {
  auto it = nodes_.find(ino);
  if (it == nodes_.end() || it->second->retired) return;
  if (it->second->key.space == Space::Virtual) {
    it->second->superseded = true;  // its key names this version only: it stays
    return;
  }
  if (it->second->key.space != Space::Real) return;
  it->second->retired = true;
  if (auto k = keys_.find(it->second->key); k != keys_.end() && k->second == ino) keys_.erase(k);
}

void NodeTable::retire(Ino ino) {
  std::lock_guard lock(mu_);
  retire_locked(ino);
}

void NodeTable::retire_key(const Key& key) {
  std::lock_guard lock(mu_);
  if (auto k = keys_.find(key); k != keys_.end()) retire_locked(k->second);
}

std::optional<Node> NodeTable::child(Ino parent, const std::string& name) const {
  std::lock_guard lock(mu_);
  if (auto k = kids_.find({parent, name}); k != kids_.end()) {
    if (auto it = nodes_.find(k->second); it != nodes_.end()) return *it->second;
  }
  return std::nullopt;
}

void NodeTable::for_each_kid(Ino dir,
                             const std::function<void(const std::string&, const Node*)>& fn) const {
  std::lock_guard lock(mu_);
  for (auto it = kids_.lower_bound({dir, std::string()});
       it != kids_.end() && it->first.first == dir; ++it) {
    auto n = nodes_.find(it->second);
    fn(it->first.second, n == nodes_.end() ? nullptr : n->second.get());
  }
}

std::shared_ptr<DirState> NodeTable::dir_state(uint64_t dev, uint64_t ino) {
  std::lock_guard lock(mu_);
  auto& s = dirs_[{dev, ino}];
  if (!s) s = std::make_shared<DirState>();
  return s;
}

std::shared_ptr<DirState> NodeTable::find_dir(uint64_t dev, uint64_t ino) const {
  std::lock_guard lock(mu_);
  auto it = dirs_.find({dev, ino});
  return it == dirs_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<DirState>> NodeTable::dirs() const {
  std::vector<std::shared_ptr<DirState>> all;
  std::lock_guard lock(mu_);
  for (const auto& [k, v] : dirs_) all.push_back(v);
  return all;
}

NodeTable::Sizes NodeTable::sizes() const {
  std::lock_guard lock(mu_);
  return Sizes{nodes_.size(), keys_.size(), dirs_.size()};
}

}  // namespace ckptfs::fs

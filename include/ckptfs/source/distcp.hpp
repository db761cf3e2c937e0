// The source of torch DCP checkpoints: a directory's `.metadata` and `.distcp` files read into
// the chunks the layout builds consolidated files from.
//
// A directory is a DCP checkpoint when it holds a regular `.metadata` (DCP's commit point,
// written last) and at least one `*.distcp` file, and no rank shards of the safetensors form.
// Which tensors are served, under which names (docs/formats.md):
// - a top-level `model` key (`{"model": get_model_state_dict(m), "optimizer": ...}`) is the
//   model: its tensors are served under their keys below it, and nothing else is;
// - otherwise every tensor is served under its flattened key, except those under a top-level
//   key that holds training state (optimizer, lr_scheduler, dataloader, train_state, rng...);
// - non-tensor items (BytesStorageMetadata) are never served.
// The served tensors are packed in `.metadata`'s order into output files of at most
// kMaxOutputBytes each (a larger tensor has a file of its own).
#pragma once

#include <string>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"

namespace ckptfs::source {

using layout::kMaxOutputBytes;  // the packing rule is the layout's (maps repack too)
using layout::OutputPacker;
inline constexpr uint64_t kMaxTensorPickleBytes = 1 << 20;  // one chunk's data.pkl
// A chunk's archive is torch.save of one tensor: 7 members as torch 2.x writes it (data.pkl,
// data/0, version, byteorder, .data/serialization_id, .format_version, .storage_alignment).
// verl's whole-state-dict archives keep zip::Limits' defaults (65,536 members, 64 MiB).
inline constexpr size_t kMaxChunkArchiveMembers = 64;
inline constexpr uint64_t kMaxChunkDirectoryBytes = 64 << 10;  // its central directory

// `.metadata` or a `*.distcp` file: the inputs of a DCP checkpoint.
bool is_distcp_entry(const DirEntry& e);
bool is_distcp_dir(const std::vector<DirEntry>& entries);

// Fills `in` (dir set by the caller) with the directory's DCP chunks, or with the problems
// that keep it from being served. Reads `.metadata`, then each file it names in turn, one
// descriptor at a time: every chunk's archive structure in it. A file must be a `*.distcp`
// of this directory, and none may be newer than `.metadata` (DCP writes it last: a newer one
// is a later save running or cut short, which would mix two versions).
// `prefix` ("pytorch_model_fsdp_0/": accelerate's layout, where `dirfd` is that folder of the
// checkpoint directory) is put before every file name the checkpoint records.
void read_distcp_input(int dirfd, layout::BuildInput& in, std::string_view prefix = {});

// accelerate's FSDP layout: CKPT/pytorch_model_fsdp_0/ holds the model as a torch DCP
// checkpoint, beside CKPT/config.json (Trainer's `checkpoint-N/`, `Accelerator.save_state`).
// CKPT itself is then the checkpoint directory: its view shows the consolidated files where
// from_pretrained looks for them. Its inputs are listed under "pytorch_model_fsdp_0/<name>".
inline constexpr std::string_view kAccelerateModelDir = "pytorch_model_fsdp_0";
// Whether `entries` (list_checkpoint_dir's) hold accelerate's folder with a DCP checkpoint.
bool is_accelerate_dir(const std::vector<DirEntry>& entries);

}  // namespace ckptfs::source

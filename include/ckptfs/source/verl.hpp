// The source of verl's FSDP checkpoints: a directory's `model_world_size_W_rank_R.pt` files
// and fsdp_config.json read into the chunks the layout builds consolidated files from.
//
// A directory is a verl checkpoint when it holds a regular fsdp_config.json and at least one
// `model_world_size_W_rank_R.pt`, and neither safetensors rank shards nor a DCP checkpoint.
// Every rank 0..W-1 of fsdp_config.json's world size must be there. Each rank's DTensors are
// tiled by their placements (docs/formats.md): Shard(d) on a mesh dimension of size n holds
// chunk c of n along d with torch.chunk's split (so the last ranks may hold fewer rows or
// none); a Replicate dimension is taken from coordinate 0. Plain tensors are taken from rank
// 0. FSDP1 (verl's default strategy) and FSDP2 are read alike: verl gives FSDP1 a device mesh,
// so its rank files hold DTensors too (HSDP: [Replicate, Shard(0)] on a ("ddp", "fsdp") mesh).
// The tensors are served under their state-dict keys, in rank 0's order, packed as the DCP
// source packs them (OutputPacker); with a lora_train_meta.json (a PEFT LoRA model) the layout's
// LoRA split serves them as a base model and an adapter (layout/lora.hpp). The optim_/extra_state_
// files are never read.
#pragma once

#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"

namespace ckptfs::source {

// fsdp_config.json, lora_train_meta.json or a `model_world_size_W_rank_R.pt` file: the inputs of
// a verl checkpoint.
bool is_verl_entry(const DirEntry& e);
bool is_verl_dir(const std::vector<DirEntry>& entries);

// Fills `in` (dir set by the caller) with the checkpoint's chunks, or with the problems that
// keep it from being served. Reads fsdp_config.json and each model rank file's zip directory
// and data.pkl, one rank at a time: rank 0 is kept whole (the reference); every other rank is
// checked against it (keys, dtypes, global sizes, placements) and dropped, keeping per tensor
// only its mesh coordinate, local size and bytes' offset. So memory is two ranks' parses plus a
// few numbers per (rank, tensor), not W parses. Two ranks that are one file (hard links; verl
// never writes them) are refused from the listing, before any rank is read; the first rank
// with a problem ends the reading.
void read_verl_input(int dirfd, const std::vector<DirEntry>& entries, layout::BuildInput& in);

}  // namespace ckptfs::source

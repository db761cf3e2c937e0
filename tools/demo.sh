#!/usr/bin/env bash
# ckptfs demo, end to end, on a fresh Debian 12 machine (as root). Idempotent; run from anywhere.
#   1. tools/setup.sh: Debian packages + the Python venv (torch, transformers, safetensors)
#   2. build: meson setup build (first time only) + ninja -C build, under a build lock
#   3. generate a small Llama checkpoint as REAL torch DCP rank shards: fsdp_tp on 4 ranks
#      (dp 2 x tp 2), NeMo AutoModel layout (tools/gen_checkpoint.py), plus its
#      save_pretrained reference; reused on later runs
#   4. ckptfs mount SRC MNT
#   5. tools/demo.py: from_pretrained(MNT/.../model), checked against the reference (tensors,
#      logits, greedy generation from fixed token ids), and timed against "consolidate with
#      torch first, then load"; one summary line
#   6. save_pretrained into the mount; 7. ckptfs load of the shards; 8. a native torch DCP
#      save (FSDP2, 2 ranks) into the mount, served as HF; 9. verl's own FSDP checkpoint
#      manager saves into the mount (2 ranks), served as HF with its huggingface/ config, and a
#      LoRA checkpoint: the base model, and lora_adapter/ loaded with PEFT; then mounted with
#      -o lora=merged: the merged model, as PEFT's merge_and_unload() gives it
#   10. torchtitan's own checkpointer (FSDP2, 2 ranks) saves a Llama into the mount, under its
#      own names and RoPE row order; the built-in model map torchtitan-llama3 serves it under
#      HF's (issue 22, docs/maps.md), a Qwen3-MoE through torchtitan-qwen3-moe and a gpt-oss
#      through torchtitan-gpt-oss (its experts transposed on read); megatron-core's
#      dist_checkpointing saves a DeepSeek-V3-shaped model, served with config.json made from
#      its own args, and the same checkpoint as Megatron-Bridge keeps it (its run_config.yaml);
#   11. unmount (always, from a trap)
# Exit status: non-zero if any step or check fails. Needs no network beyond apt and PyPI
# (set-up only); nothing is fetched from the HuggingFace hub.
# Environment: CKPTFS_DEMO_DIR (work dir, default /tmp/ckptfs-demo), CKPTFS_CACHE (venv, see setup.sh)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
WORK=${CKPTFS_DEMO_DIR:-/tmp/ckptfs-demo}
SRC=$WORK/src                       # what is mounted: a training run with one step
CK=$SRC/run/step_1000               # the checkpoint (NeMo layout: shards in $CK/model/)
REF=$WORK/reference/step_1000       # save_pretrained output of the same model
MNT=$WORK/mnt
MERGED=$WORK/merged                 # a second mount, -o lora=merged (step 9)
BIN=$ROOT/build/src/ckptfs
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
GEN_OPTS=(--layout fsdp_tp --world 4 --tp 2 --nemo --files 2 --layers 4 --hidden 512
          --intermediate 1408 --heads 8 --kv-heads 4 --vocab 16000 --dtype bf16 --seed 0)

step() { printf '\n=== %s\n' "$*"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# from_pretrained(DIR) equals the trained model saved in REF (and, with a third argument, the
# tokenizer loads from DIR too); one summary line, non-zero on a difference.
check_from_pretrained() {
  "$PY" - "$@" <<'PYEOF'
import sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

d, ref, tokenizer = sys.argv[1], sys.argv[2], len(sys.argv) > 3
want = {k: v.clone() for k, v in load_file(ref).items()}
sd = AutoModelForCausalLM.from_pretrained(d).state_dict()
bad = [k for k in want if not torch.equal(sd[k], want[k])]
tok = f"; tokenizer: {type(AutoTokenizer.from_pretrained(d)).__name__}" if tokenizer else ""
print(f"from_pretrained({d}): {len(want)} tensors, {'all equal to the trained model' if not bad else 'DIFFER: ' + str(bad)}{tok}")
sys.exit(1 if bad else 0)
PYEOF
}

step "1/11 set-up (tools/setup.sh)"
VENV=$(tools/setup.sh | tail -n 1)
PY=$VENV/bin/python
echo "venv: $VENV ($("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"

step "2/11 build"
mkdir -p "$WORK"
if ! flock /tmp/ckptfs-build.lock bash -c '[[ -f build/build.ninja ]] || meson setup build; ninja -C build' \
     >"$WORK/build.log" 2>&1; then
  tail -n 40 "$WORK/build.log"
  echo "demo: build failed (full log: $WORK/build.log)" >&2
  exit 1
fi
tail -n 1 "$WORK/build.log"
"$BIN" --help | head -n 1

step "3/11 sharded checkpoint (torch DCP, fsdp_tp on 4 ranks, NeMo layout)"
stamp=$WORK/generated.json          # written last: an interrupted generation is redone
want="${GEN_OPTS[*]}"
if [[ -f $stamp ]] && [[ "$(sed -n 1p "$stamp")" == "$want" ]] &&
   (($(find "$CK/model" -maxdepth 1 -name 'shard-*.safetensors' 2>/dev/null | wc -l) == 4)) &&
   [[ -f $REF/config.json ]]; then
  echo "reusing $CK (generated earlier with: $want)"
else
  rm -rf "$CK" "$REF" "$stamp"
  mkdir -p "$(dirname "$CK")" "$(dirname "$REF")"
  summary=$("$PY" tools/gen_checkpoint.py "$CK" --reference "$REF" "${GEN_OPTS[@]}" | tail -n 1)
  printf '%s\n%s\n' "$want" "$summary" >"$stamp"
fi
find "$CK" -type f -printf '  %12s B  %P\n' | sort -k3

step "4/11 mount"
DAEMON=
# shellcheck disable=SC2317  # invoked from the trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  grep -qs " $MERGED fuse" /proc/mounts && fusermount3 -u -z "$MERGED" 2>/dev/null
  if grep -qs " $MNT fuse" /proc/mounts; then
    for _ in $(seq 50); do
      fusermount3 -u "$MNT" 2>/dev/null && break
      sleep 0.1
    done
    grep -qs " $MNT fuse" /proc/mounts && fusermount3 -u -z "$MNT" 2>/dev/null
    echo "unmounted $MNT"
  fi
  if [[ -n $DAEMON ]]; then
    for _ in $(seq 100); do kill -0 "$DAEMON" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$DAEMON" 2>/dev/null && kill "$DAEMON" 2>/dev/null
    wait "$DAEMON" 2>/dev/null || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if grep -qs " $MNT fuse" /proc/mounts; then   # left over from an interrupted run
  fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT"
fi
mkdir -p "$MNT"
# Foreground daemon in the background: this script knows its pid (for the RSS report and a
# clean wait at the end), and its log goes to $WORK/ckptfs.log.
t0=$(now_ms)
"$BIN" mount "$SRC" "$MNT" -f -o ranks=4 >"$WORK/ckptfs.log" 2>&1 &
DAEMON=$!
for _ in $(seq 200); do
  grep -qs " $MNT fuse" /proc/mounts && break
  kill -0 "$DAEMON" 2>/dev/null || { cat "$WORK/ckptfs.log"; echo "demo: ckptfs mount failed" >&2; exit 1; }
  sleep 0.05
done
grep -qs " $MNT fuse" /proc/mounts || { cat "$WORK/ckptfs.log"; echo "demo: no mount after 10 s" >&2; exit 1; }
ms=$(($(now_ms) - t0))
mount_s=$((ms / 1000)).$(printf '%03d' $((ms % 1000)))
echo "$BIN mount $SRC $MNT   (daemon pid $DAEMON, log $WORK/ckptfs.log)"

step "5/11 from_pretrained through the mount, checked against the original model"
status=0
"$PY" tools/demo.py --view "$MNT/run/step_1000/model" --shards "$CK/model" --reference "$REF" \
  --daemon-pid "$DAEMON" --mount-seconds "$mount_s" --work "$WORK" || status=$?

step "6/11 save_pretrained into the mount (stored as 4 rank shards, read back exactly)"
if ((status == 0)); then
  "$PY" tools/demo_write.py --reference "$REF" --out "$MNT/run/step_2000/model" \
    --src "$SRC/run/step_2000/model" --plain "$WORK/plain/step_2000" \
    --status "$MNT/.ckptfs/status.json" || status=$?
fi
if ((status == 0)); then
  echo
  echo "what the daemon says it is doing (ckptfs status $MNT):"
  "$BIN" status "$MNT" || status=$?
fi

step "7/11 ckptfs load: the rank shards into memory without a mount (the loader, issue 12)"
if ((status == 0)); then
  # The loader reads the shards through the extent map; the mount serves the consolidated
  # files. The same tensors give the same checksum (XXH64 per tensor, in name order).
  direct=$("$BIN" load "$CK/model" --bench) || status=$?
  echo "$direct"
  via=$("$BIN" load "$MNT/run/step_1000/model" | tail -n 1) || status=$?
  echo "through the mount (consolidated files): $via"
  if ((status == 0)) && [[ "$(tail -n 1 <<<"$direct")" != "$via" ]]; then
    echo "demo: the loader's checksum differs from the mount's" >&2
    status=1
  fi
fi

step "8/11 a native torch DCP checkpoint (dcp.save of FSDP2 on 2 ranks, with optimizer state) saved into the mount and served as HF"
if ((status == 0)); then
  # The writer is torch's own default (FileSystemWriter): .metadata and one .distcp per rank,
  # stored as written; the mount adds model-*.safetensors and the index beside them.
  rm -rf "$SRC/run/dcp_step_3000" "$SRC/run/reference-dcp_step_3000.safetensors"
  "$PY" tests/python/writers/dcp_fsdp_save.py "$MNT/run/dcp_step_3000" --ranks 2 --wrap \
    >"$WORK/dcp_save.log" 2>&1 || { tail -n 20 "$WORK/dcp_save.log"; status=1; }
fi
if ((status == 0)); then
  ls -la "$MNT/run/dcp_step_3000"
  "$BIN" inspect "$SRC/run/dcp_step_3000" | grep -E "format|left out|training state|non-tensor" || true
  check_from_pretrained "$MNT/run/dcp_step_3000" "$MNT/run/reference-dcp_step_3000.safetensors" || status=$?
fi

step "9/11 verl's FSDP checkpoint manager (FSDP2, 2 ranks) saves into the mount; from_pretrained of its actor directory"
if ((status == 0)); then
  # verl writes model_world_size_2_rank_R.pt per rank, fsdp_config.json and huggingface/
  # (config, tokenizer), stored as written; the mount adds the consolidated files beside them,
  # where verl.model_merger would have written a copy. (The writer also runs that merger, on
  # the files through the mount, and checks it against the trained model.)
  # The same ranks then save a second checkpoint with LoRA (rank 8, all-linear; verl's own
  # _build_lora_module): its rank files hold PEFT's names.
  rm -rf "$SRC/run/verl" "$SRC/run/merged-verl" "$SRC/run/reference-verl.safetensors" \
    "$SRC/run/verl-lora" "$SRC/run/"{peft-reference-verl-lora,logits-verl-lora.safetensors} \
    "$SRC/run/"{base-reference-verl-lora.safetensors,merged-reference-verl-lora.safetensors}
  "$PY" tests/python/writers/verl_save.py "$MNT/run/verl" --ranks 2 --case "$MNT/run/verl-lora:--lora 8" \
    >"$WORK/verl_save.log" 2>&1 || { tail -n 20 "$WORK/verl_save.log"; status=1; }
fi
if ((status == 0)); then
  ACTOR=$MNT/run/verl/global_step_1/actor
  ls -la "$ACTOR"
  "$BIN" inspect "$SRC/run/verl/global_step_1/actor" | grep -E "format|left out|training state" || true
  check_from_pretrained "$ACTOR" "$MNT/run/reference-verl.safetensors" tokenizer || status=$?
fi
if ((status == 0)); then
  # LoRA: the base model under HF names in the directory, PEFT's adapter in lora_adapter/
  # (adapter_config.json from lora_train_meta.json); both checked against PEFT's own unload()
  # and save_pretrained, then loaded with PeftModel.from_pretrained (issue 33).
  LACTOR=$MNT/run/verl-lora/global_step_1/actor
  ls -la "$LACTOR" "$LACTOR/lora_adapter"
  "$BIN" inspect "$SRC/run/verl-lora/global_step_1/actor" | grep -E "format:|^  lora:" || true
  check_from_pretrained "$LACTOR" "$MNT/run/base-reference-verl-lora.safetensors" || status=$?
  if cmp -s "$LACTOR/lora_adapter/adapter_model.safetensors" \
       "$MNT/run/peft-reference-verl-lora/adapter_model.safetensors"; then
    echo "lora_adapter/adapter_model.safetensors: byte for byte PEFT's own save_pretrained"
  else
    echo "demo: lora_adapter/adapter_model.safetensors differs from PEFT's save_pretrained" >&2
    status=1
  fi
  ((status == 0)) && { "$PY" tools/demo.py --lora-view "$LACTOR" --tokens 8 || status=$?; }
fi
if ((status == 0)); then
  # The same rank files mounted with -o lora=merged (a second mount, of the run's directory):
  # the model PEFT's merge_and_unload() gives, W + scale * (B @ A) computed on read, checked
  # against the writer's own merge_and_unload().
  mkdir -p "$MERGED"
  "$BIN" mount "$SRC/run/verl-lora" "$MERGED" -o lora=merged,settle=0 --log-file "$WORK/merged.log" ||
    status=$?
  if ((status == 0)); then
    ls "$MERGED/global_step_1/actor"
    check_from_pretrained "$MERGED/global_step_1/actor" \
      "$MNT/run/merged-reference-verl-lora.safetensors" || status=$?
    fusermount3 -u "$MERGED" || status=$?
  fi
fi

step "10/11 torchtitan's checkpointer and megatron-core save into the mount; served under HF names through the model maps torchtitan-llama3, torchtitan-qwen3-moe, torchtitan-gpt-oss and megatron-deepseek-v3"
if ((status == 0)); then
  # torchtitan 0.3.0 stores tok_embeddings, layers.N.attention.qkv_linear.wq (rows permuted for
  # RoPE), feed_forward.w1/w2/w3...: the writer converts an HF Llama with torchtitan's own
  # from_hf and saves it with its CheckpointManager. The view maps it back, with no copy.
  # And a Qwen3-MoE (4 experts stored grouped, [experts, ...], split over the ranks on the
  # expert axis): torchtitan-qwen3-moe serves every expert under HF's names.
  rm -rf "$SRC/run/titan"
  "$PY" tests/python/writers/titan_map_save.py "$MNT/run/titan" --ranks 2 --models llama3,qwen3-moe \
    >"$WORK/titan_save.log" 2>&1 || { tail -n 20 "$WORK/titan_save.log"; status=1; }
fi
if ((status == 0)); then
  STEP=$MNT/run/titan/llama3/checkpoint/step-1
  ls -la "$STEP"
  "$BIN" inspect "$SRC/run/titan/llama3/checkpoint/step-1" | grep -E "format|model map|q_proj" | head -n 4 || true
  check_from_pretrained "$STEP" "$MNT/run/titan/llama3/original.safetensors" || status=$?
fi
if ((status == 0)); then
  # torchtitan writes no config.json: the user puts the HF one beside the step, as for any map.
  MOE=$MNT/run/titan/qwen3-moe/checkpoint/step-1
  cp "$MNT/run/titan/qwen3-moe/hf/config.json" "$MOE/"
  "$BIN" inspect "$SRC/run/titan/qwen3-moe/checkpoint/step-1" | grep -E "format|model map|experts" | head -n 4 || true
  check_from_pretrained "$MOE" "$MNT/run/titan/qwen3-moe/original.safetensors" || status=$?
fi

if ((status == 0)); then
  # gpt-oss: torchtitan stores each layer's experts as [experts, out, in] (mlp1_weight_EGD...),
  # HF's GptOssExperts holds [experts, in, out]: torchtitan-gpt-oss serves them transposed,
  # computed on read (its to_hf, which drops the experts in 0.3.0, is the reference for the rest).
  rm -rf "$SRC/run/titan-oss"
  "$PY" tests/python/writers/titan_family_save.py "$MNT/run/titan-oss" --ranks 2 --models gpt-oss \
    >"$WORK/titan_oss_save.log" 2>&1 || { tail -n 20 "$WORK/titan_oss_save.log"; status=1; }
fi
if ((status == 0)); then
  OSS=$MNT/run/titan-oss/gpt-oss
  "$BIN" inspect "$SRC/run/titan-oss/gpt-oss/checkpoint/step-1" | grep -E "format|model map|gate_up_proj " |
    head -n 4 || true
  "$PY" - "$OSS" <<'PYEOF' || status=$?
import glob, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

d = sys.argv[1]
step = f"{d}/checkpoint/step-1"
served = {}
for f in sorted(glob.glob(f"{step}/model*.safetensors")):
    served.update(load_file(f))
want = load_file(f"{d}/to_hf.safetensors")  # to_hf: every tensor but the experts
names = {"mlp1_weight_EGD": "gate_up_proj", "mlp1_bias_EG": "gate_up_proj_bias",
         "mlp2_weight_EDF": "down_proj", "mlp2_bias_ED": "down_proj_bias"}
for k, v in load_file(f"{d}/stored.safetensors").items():  # the experts, in HF's layout
    p, _, leaf = k.rpartition(".")
    if leaf in names:
        want[f"model.layers.{p.split('.')[1]}.mlp.experts.{names[leaf]}"] = v.transpose(-2, -1) if "weight" in leaf else v
bad = sorted(k for k in want if k not in served or not torch.equal(served[k], want[k]))
model, info = AutoModelForCausalLM.from_pretrained(step, output_loading_info=True)
print(f"from_pretrained({step}): {type(model).__name__}; {len(want)} tensors "
      f"{'all equal to to_hf and the transposed experts' if not bad else 'DIFFER: ' + str(bad[:4])}; "
      f"missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")
sys.exit(0 if not bad and not info["missing_keys"] and not info["unexpected_keys"] else 1)
PYEOF
fi

if ((status == 0)); then
  # Megatron-Core: a DeepSeek-V3-shaped model (multi-latent attention with YaRN RoPE, MLA's
  # default, a dense first layer, then MoE with 4 routed experts, a router expert bias and a
  # shared expert), TP 2, saved by megatron-core's own dist_checkpointing into the mount in
  # Megatron-LM's layout. No options: the map megatron-deepseek-v3 is detected and config.json
  # (rope_parameters included) is made from common.pt's args.
  rm -rf "$SRC/run/megatron" "$WORK/megatron-ref"
  "$PY" tests/python/writers/megatron_families_save.py "$MNT/run/megatron" "$WORK/megatron-ref" \
    dsv3:deepseek_v3:2:1:1:0:float32:yarn >"$WORK/megatron_save.log" 2>&1 ||
    { tail -n 20 "$WORK/megatron_save.log"; status=1; }
fi
# from_pretrained(DIR) of a Megatron-Core DeepSeek-V3 view: its files name by name against the
# original (transformers 5 holds these experts fused in memory), then the model's logits.
check_megatron() {
  "$PY" - "$1" "$2" <<'PYEOF'
import glob, json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

d, ref = sys.argv[1], sys.argv[2]
served = {}
for f in sorted(glob.glob(f"{d}/model*.safetensors")):
    served.update(load_file(f))
want = load_file(f"{ref}/model.safetensors")
bad = sorted(k for k in want if k not in served or not torch.equal(served[k], want[k]))
config = json.load(open(f"{d}/config.json"))
arch, rope = config["architectures"], config["rope_parameters"]["rope_type"]
model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
ids = torch.tensor([[3, 17, 5, 99, 42, 7]])
same = torch.equal(model(ids).logits, AutoModelForCausalLM.from_pretrained(ref)(ids).logits)
print(f"from_pretrained({d}): config.json says {arch}, {rope} RoPE; {len(want)} tensors "
      f"{'all equal to the original' if not bad else 'DIFFER: ' + str(bad[:4])}; missing "
      f"{info['missing_keys']}, unexpected {info['unexpected_keys']}; logits "
      f"{'equal to the original model' if same else 'DIFFER'}")
sys.exit(0 if not bad and same and not info["missing_keys"] and not info["unexpected_keys"] else 1)
PYEOF
}
if ((status == 0)); then
  DSV3=$MNT/run/megatron/dsv3/iter_0000010
  "$BIN" inspect "$SRC/run/megatron/dsv3/iter_0000010" | grep -E "format|model map" | head -n 3 || true
  check_megatron "$DSV3" "$WORK/megatron-ref/dsv3" || status=$?
fi
if ((status == 0)); then
  # Megatron-Bridge saves the same layout with no args in common.pt and its run's config in
  # iter_N/run_config.yaml (written here by Megatron-Bridge's own ConfigContainer.to_yaml for
  # the provider its AutoBridge makes of the original): config.json is made from its `model`.
  rm -rf "$SRC/run/bridge"
  mkdir -p "$SRC/run/bridge"
  cp -a "$SRC/run/megatron/dsv3" "$SRC/run/bridge/dsv3"  # -a: DCP writes .metadata last
  B=$SRC/run/bridge/dsv3/iter_0000010
  "$PY" -c 'import sys, torch; p = sys.argv[1]; sd = torch.load(p, weights_only=False); del sd["args"]; torch.save(sd, p)' \
    "$B/common.pt" && "$PY" tests/python/writers/bridge_run_config.py "$WORK/megatron-ref/dsv3:$B:2:1:1" \
    >"$WORK/bridge_save.log" 2>&1 || { tail -n 20 "$WORK/bridge_save.log"; status=1; }
fi
if ((status == 0)); then
  "$BIN" inspect "$B" | grep -E "model map" | head -n 1 || true
  check_megatron "$MNT/run/bridge/dsv3/iter_0000010" "$WORK/megatron-ref/dsv3" || status=$?
fi

step "11/11 unmount"
exit "$status"

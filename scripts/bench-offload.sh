#!/usr/bin/env bash
# Regenerates the offload section of BENCHMARKS.md: the disk's own O_DIRECT bandwidth, the
# ZeRO-Infinity swapper's pass over an optimizer state (io_uring and pread) and the tiled
# Adam step from a swap file against the in-memory step, measured in one run of `swap-bench`;
# then GPT `small` at ZeRO stage 3 on 2 thread ranks with the optimizer in memory and on disk.
# DIR (default: the system's temp folder) should be on the disk the swap files would use.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${DIR:-${TMPDIR:-/tmp}}"
STATE_MB="${STATE_MB:-1536}"
REPS="${REPS:-3}"
STEPS="${STEPS:-6}"
out="${CARGO_TARGET_DIR:-target}/bench-offload"
mkdir -p "$out"
cargo bench -p burn-deepspeed-strategies --bench swap-bench -- \
    --dir "$DIR" --state-mb "$STATE_MB" --reps "$REPS" --json | tail -n 1 > "$out/swap.json"
cargo build --release --example gpt
for offload in none nvme; do
    cat > "$out/ds_$offload.json" <<JSON
{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
 "zero_optimization": {"stage": 3, "sub_group_size": 500000,
   "offload_optimizer": {"device": "$offload", "nvme_path": "$DIR",
                         "pipeline_read": true, "pipeline_write": true}}}
JSON
    "${CARGO_TARGET_DIR:-target}/release/examples/gpt" --model small --ranks 2 --steps "$STEPS" \
        --config "$out/ds_$offload.json" --json | tail -n 1 > "$out/gpt_$offload.json"
done
python3 scripts/benchmarks_md.py offload "$out" "$(nproc)"

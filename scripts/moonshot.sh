#!/usr/bin/env bash
# ZeRO-Infinity's moonshot (issue 19): GPT `xl` (2.01B parameters; its fp32 Adam state alone
# is 32 GB) trains STEPS optimizer steps on one machine at ZeRO stage 3 with its parameters
# and optimizer state in swap files, and the moonshot section of BENCHMARKS.md is rewritten
# from the run: losses, seconds per step, peak RSS (the report's and `time -v`'s), and the
# swap throughput beside the disk's own O_DIRECT bandwidth measured in the same run.
# DIR (default: the system's temp folder) must be on a disk with about 35 GB free.
# The first runs, at a constant lr (1e-3, 1e-4), saw the loss rise after the first step
# (1e-4: 5.84 -> 12.41 -> 14.01 -> 12.69 -> 9.36): Adam's first, sign-like step moves every
# weight of a model this wide and deep at once. The same spike shows in RAM on the xl width
# at 12 blocks (`--layers 12`, constant 1e-5: 5.81 -> 8.77), and a linear warm-up removes it
# there (0 -> 2e-5 over 8 steps: 5.81 -> 5.86 -> 4.43 -> 4.29 -> 4.29 -> 3.73), hence WarmupLR.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${DIR:-${TMPDIR:-/tmp}}/burn-deepspeed-xl"
STEPS="${STEPS:-5}"
out="${CARGO_TARGET_DIR:-target}/moonshot"
mkdir -p "$out" "$DIR"
cat > "$out/ds_xl.json" <<JSON
{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "steps_per_print": 1,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-6, "warmup_max_lr": 1e-5,
                                             "warmup_num_steps": 8, "warmup_type": "linear"}},
 "activation_checkpointing": {},
 "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
         "single_submit": false, "overlap_events": true},
 "zero_optimization": {"stage": 3, "sub_group_size": 10000000,
   "offload_optimizer": {"device": "nvme", "nvme_path": "$DIR",
                         "pipeline_read": true, "pipeline_write": true},
   "offload_param": {"device": "nvme", "nvme_path": "$DIR",
                     "buffer_count": 4, "buffer_size": 20000000, "max_in_cpu": 0}}}
JSON
cargo build --release --example gpt
# glibc raises its mmap threshold as large buffers are freed and then keeps them in its heap;
# a fixed threshold hands freed gathered weights back to the system.
MALLOC_MMAP_THRESHOLD_=65536 /usr/bin/time -v \
    "${CARGO_TARGET_DIR:-target}/release/examples/gpt" --model xl --steps "$STEPS" \
    --config "$out/ds_xl.json" --measure-disk-gb 4 --json \
    > "$out/xl.json" 2> "$out/xl.err"
tail -n 1 "$out/xl.json" > "$out/xl.last.json"
python3 scripts/benchmarks_md.py moonshot "$out" "$(nproc)" "$(free -b | awk '/^Mem:/ {print $2}')"

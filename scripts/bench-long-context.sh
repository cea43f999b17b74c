#!/usr/bin/env bash
# Regenerates the long-context section of BENCHMARKS.md: the longest sequence GPT `small`
# (d 256, 8 layers, 8 heads) trains one optimizer step at on this machine, one sequence per
# step, in three ways:
#   plain: one rank, every activation kept (the [t, t] scores of each head included);
#   long:  one rank, blockwise attention, MLP and loss in tiles of TILE positions, each block
#          an activation checkpoint held in host memory (`cpu_checkpointing`);
#   sp4:   as long, with each sequence cut over 4 thread ranks (`sequence_parallel_size` 4).
# Each way climbs its ladder of lengths (PLAIN, LONG, SP4) and stops at the first length that
# fails (out of memory: the process is limited to MEM_GB of address space; or past LIMIT_S
# seconds). Every run's peak RSS (the kernel's, of the whole process), activation heap (the
# example's counting allocator: the most one step held above what was live before it, all
# thread ranks of the process together) and tokens/s are measured. Then tokens/s at sp 2
# against sp 1 (the long way, 2 thread ranks against 1) at SPEED_LEN positions, STEPS steps.
# The time of a step grows with the square of the length (attention): at sp 4 on 2 cores,
# 32K positions took about 10 minutes and 64K about 47. A point can be added on another day,
# keeping the runs already made:  KEEP=1 PLAIN="" LONG="" SP4="65536" SPEED_LEN="" bash <this script>
set -euo pipefail
cd "$(dirname "$0")/.."
PLAIN="${PLAIN-4096 8192 10240 12288 14336}"
LONG="${LONG-16384 32768}"
SP4="${SP4-16384 32768 65536}"
TILE="${TILE:-1024}"
MEM_GB="${MEM_GB:-22}"
LIMIT_S="${LIMIT_S:-3600}"
SPEED_LEN="${SPEED_LEN-4096}"
STEPS="${STEPS:-3}"
target="${CARGO_TARGET_DIR:-target}"
out="${OUT:-$target/bench-long-context}"
# GPT: an example binary built already (a run that must not see later rebuilds), else built.
if [ -n "${GPT:-}" ]; then
    gpt="$GPT"
else
    cargo build --release -p burn-deepspeed-example-gpt --example gpt
    gpt="$target/release/examples/gpt"
fi
# KEEP=1 adds to the runs already in OUT (a longer point on another day) instead of starting
# afresh; an empty ladder or SPEED_LEN skips that part.
[ -n "${KEEP:-}" ] || rm -rf "$out"
mkdir -p "$out"
# Training bytes: the embedded corpus repeated past the longest length.
for _ in 1 2 3 4 5 6 7 8; do cat examples/gpt/data/corpus.txt; done > "$out/corpus.txt"
config() { # SP CHECKPOINTS
    local ckpt=""
    [ "$2" = yes ] && ckpt=', "activation_checkpointing": {"cpu_checkpointing": true}'
    echo "{\"train_batch_size\": 1, \"train_micro_batch_size_per_gpu\": 1,
      \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}},
      \"sequence_parallel_size\": $1 $ckpt}"
}
config 1 no > "$out/plain.json"
config 1 yes > "$out/long.json"
config 2 yes > "$out/sp2.json"
config 4 yes > "$out/sp4.json"
run() { # NAME WAY LEN RANKS CONFIG STEPS EXTRA...
    local name=$1 way=$2 len=$3 ranks=$4 cfg=$5 steps=$6
    shift 6
    local start rc=0
    start=$(date +%s)
    ( ulimit -v $((MEM_GB * 1024 * 1024))
      exec timeout "$LIMIT_S" "$gpt" --model small --seq-len "$len" --ranks "$ranks" \
        --config "$out/$cfg.json" --steps "$steps" --data "$out/corpus.txt" --json "$@" \
    ) > "$out/$name.out" 2> "$out/$name.err" || rc=$?
    local took=$(( $(date +%s) - start ))
    python3 - "$out" "$name" "$way" "$len" "$ranks" "$rc" "$took" "$MEM_GB" "$LIMIT_S" <<'PY'
import json, sys
out, name, way, length, ranks, rc, took, mem_gb, limit_s = sys.argv[1:]
row = {"name": name, "way": way, "seq_len": int(length), "ranks": int(ranks),
       "exit": int(rc), "seconds": int(took), "mem_gb": int(mem_gb), "limit_s": int(limit_s)}
lines = open(f"{out}/{name}.out").read().splitlines()
if int(rc) == 0 and lines:
    row["report"] = json.loads(lines[-1])
else:
    err = open(f"{out}/{name}.err").read().strip().splitlines()
    # The cause: an allocation failure's or a panic's own line, not the backtrace after it.
    cause = [l for l in err if l.startswith(("memory allocation", "error", "thread "))]
    row["error"] = "timed out" if int(rc) == 124 else (cause or err or [f"exit {rc}"])[0]
with open(f"{out}/runs.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print(f"{name}: {'ok' if int(rc) == 0 else row['error']} in {took} s", flush=True)
PY
    return "$rc"
}
ladder() { # WAY RANKS CONFIG LENGTHS EXTRA...
    local way=$1 ranks=$2 cfg=$3 lengths=$4
    shift 4
    for len in $lengths; do
        run "$way-$len" "$way" "$len" "$ranks" "$cfg" 1 "$@" || break
    done
}
long_args=(--blockwise-attention --tile "$TILE")
ladder plain 1 plain "$PLAIN"
ladder long 1 long "$LONG" "${long_args[@]}"
ladder sp4 4 sp4 "$SP4" "${long_args[@]}"
if [ -n "$SPEED_LEN" ]; then
    run "speed-sp1" speed-sp1 "$SPEED_LEN" 1 long "$STEPS" "${long_args[@]}"
    run "speed-sp2" speed-sp2 "$SPEED_LEN" 2 sp2 "$STEPS" "${long_args[@]}"
fi
python3 scripts/benchmarks_md.py long-context "$out" "$(nproc)"

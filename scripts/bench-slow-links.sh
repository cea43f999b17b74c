#!/usr/bin/env bash
# Regenerates the slow-links section of BENCHMARKS.md: the GPT example on an emulated cluster
# of 2 nodes x 2 MPI ranks (network namespaces, `scripts/cluster.sh`), each link shaped with
# tc to each rate of RATES. Per configuration: tokens/s over STEPS steps at each rate, the
# bytes per step that crossed the links between the nodes and that stayed inside the nodes
# (the veths' and loopbacks' counters: measured at the transport, TCP and MPI headers
# included; the timed run's less a one-step run's, over STEPS - 1), and, at the last rate, the
# losses of LOSS_STEPS steps against the uncompressed baseline of each family. The timed runs
# of the compressed optimizers compress from their second step (the first is not timed). Configurations (from examples/gpt/configs):
#   ZeRO stage 3: fp32, fp16, + qwZ, + hpZ (nodes of 2), + qgZ (nodes of 2), + all three;
#   stage 0: Adam, 1-bit Adam, 0/1 Adam; LAMB, 1-bit LAMB (freeze_step at 20% of LOSS_STEPS).
# Needs root and network namespaces (it says so and stops otherwise). No added latency: this
# kernel has no netem (see scripts/cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${MODEL:-tiny}"
STEPS="${STEPS:-12}"
LOSS_STEPS="${LOSS_STEPS:-200}"
RATES="${RATES-1gbit 10gbit}"
BATCH="${BATCH:-}"
SEQ_LEN="${SEQ_LEN:-}"
PROFILE="${PROFILE:-release}"
target="${CARGO_TARGET_DIR:-target}"
out="${OUT:-$target/bench-slow-links}"
# FEATURES (default: MPI) must name the example's and the CLI's `mpi`; a wider set (the test
# suite's) reuses its build.
# Extra runs beside the section: NAMES (a subset of the configurations) and OUT (a folder
# other than the section's) run only those, RATES="" skips the timed runs and LOSS_STEPS=0
# the loss runs; the section's generator reads two such folders when they exist:
#   MODEL=small NAMES="s3 s3-fp16 s3-zeropp" RATES=1gbit LOSS_STEPS=0 OUT=<target>/bench-slow-links-small
#   NAMES="s3 s3-zeropp" RATES="" LOSS_STEPS=200 OUT=<target>/bench-slow-links-long
# and a third with less compute per step: BATCH (sequences per step, every config) and SEQ_LEN
# (positions per sequence) shrink a step's compute, so the model's bytes weigh more against it:
#   MODEL=small BATCH=4 SEQ_LEN=32 STEPS=6 NAMES="s3 s3-fp16 s3-zeropp adam onebit_adam" RATES=1gbit LOSS_STEPS=0 OUT=<target>/bench-slow-links-bound
features="${FEATURES:-burn-deepspeed-example-gpt/mpi,burn-deepspeed-cli/mpi}"
if [ "$PROFILE" = release ]; then
    cargo build --release --example gpt --bin burn-deepspeed --features "$features"
    bin="$target/release"
else
    cargo build --example gpt --bin burn-deepspeed --features "$features"
    bin="$target/debug"
fi
gpt="$bin/examples/gpt"
cli="$bin/burn-deepspeed"
. scripts/cluster.sh
cluster_check || { echo "slow links: cannot run here: $CLUSTER_SKIP"; exit 1; }
rm -rf "$out"
mkdir -p "$out/configs"
freeze=$((LOSS_STEPS / 5))
python3 - "$out/configs" "$freeze" "$BATCH" <<'PY'
import copy, json, sys
out, freeze, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
load = lambda name: json.load(open(f"examples/gpt/configs/{name}.json"))
s3 = load("zero3")
def stage3(**keys):
    c = copy.deepcopy(s3)
    for k, v in keys.items():
        if k == "fp16":
            c["fp16"] = {"enabled": True}
        else:
            c["zero_optimization"][k] = v
    return c
configs = {
    "s3": stage3(),
    "s3-fp16": stage3(fp16=True),
    "s3-qwz": stage3(zero_quantized_weights=True),
    "s3-hpz": stage3(zero_hpz_partition_size=2),
    "s3-qgz": stage3(zero_quantized_gradients=True),
    "s3-zeropp": load("zeropp"),
    "adam": load("default"),
    "onebit_adam": load("onebit_adam"),
    "zero_one_adam": load("zero_one_adam"),
    "lamb": load("lamb"),
    "onebit_lamb": load("onebit_lamb"),
}
# The Adam family on the same betas; the 1-bit warm-up and 0/1 Adam's variance phase at 20%.
configs["adam"]["optimizer"]["params"]["betas"] = [0.9, 0.95]
configs["onebit_adam"]["optimizer"]["params"]["freeze_step"] = freeze
configs["onebit_lamb"]["optimizer"]["params"]["freeze_step"] = freeze
zo = configs["zero_one_adam"]["optimizer"]["params"]
zo["var_freeze_step"], zo["var_update_scaler"], zo["local_step_scaler"] = freeze, freeze // 2, freeze
for name, c in configs.items():
    if batch:
        c["train_batch_size"] = int(batch)
    json.dump(c, open(f"{out}/{name}.json", "w"), indent=1)
# The timed runs compress from their second step: one warm-up step (a variance of zero would
# divide by eps), and 0/1 Adam's variance frozen after it, its syncs 1, 2, 4, 8 steps apart.
for name in ("onebit_adam", "onebit_lamb", "zero_one_adam"):
    c = copy.deepcopy(configs[name])
    p = c["optimizer"]["params"]
    if "freeze_step" in p:
        p["freeze_step"] = 1
    else:
        p["var_freeze_step"], p["var_update_scaler"], p["local_step_scaler"] = 1, 1, 2
    json.dump(c, open(f"{out}/{name}-timed.json", "w"), indent=1)
PY
seq_len_args=()
[ -z "$SEQ_LEN" ] || seq_len_args=(--seq-len "$SEQ_LEN")
all="s3 s3-fp16 s3-qwz s3-hpz s3-qgz s3-zeropp adam onebit_adam zero_one_adam lamb onebit_lamb"
names="${NAMES:-$all}"
echo "{\"profile\": \"$PROFILE\", \"model\": \"$MODEL\", \"steps\": $STEPS, \"loss_steps\": $LOSS_STEPS, \"rates\": \"$RATES\", \"freeze\": $freeze, \"names\": \"$names\", \"batch\": \"$BATCH\", \"seq_len\": \"$SEQ_LEN\"}" \
    > "$out/setup.json"
# run NAME STEPS TAG: the configuration on the cluster as it is shaped now, its JSON summary
# and the bytes over the links and inside the nodes. Timed runs (TAG a rate, or `one`) of the
# compressed optimizers take their `-timed` config.
run() {
    local name=$1 steps=$2 tag=$3 links nodes rc=0 config="$out/configs/$1.json"
    [ "$tag" != loss ] && [ -f "$out/configs/$name-timed.json" ] && config="$out/configs/$name-timed.json"
    cluster_mpirun_args
    local launch_args=(--mpi 4 --hostfile "$CLUSTER_WORK/hosts")
    for a in "${CLUSTER_ARGS[@]:2}"; do launch_args+=("--mpirun-arg=$a"); done
    links=$(cluster_link_bytes)
    nodes=$(cluster_node_bytes)
    CLUSTER_JOB_TIMEOUT=3600 cluster_retrying "$tag-$name" "$gpt" -- \
        "$cli" launch "${launch_args[@]}" -- "$gpt" --model "$MODEL" \
        --config "$config" --steps "$steps" --seed 7 --json "${seq_len_args[@]}" || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 20 "$CLUSTER_WORK/$tag-$name.err"
        exit 1
    fi
    tail -n 1 "$CLUSTER_WORK/$tag-$name.out" > "$out/$tag-$name.json"
    echo "{\"links\": $(( $(cluster_link_bytes) - links )), \"nodes\": $(( $(cluster_node_bytes) - nodes ))}" \
        > "$out/$tag-$name.bytes.json"
    echo "$tag $name: $(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(round(r["tokens_per_s"]), "tokens/s, last loss", round(r["losses"][-1], 4))' "$out/$tag-$name.json"), $(cat "$out/$tag-$name.bytes.json")"
}
for rate in $RATES; do
    cluster_up 2 2 "$rate"
    for name in $names; do run "$name" "$STEPS" "$rate"; done
done
# Bytes per step: the timed run's less a one-step run's at the same shaping (the last rate's),
# which share a run's start (rank 0's parameters broadcast to every rank) and end.
if [ -n "$RATES" ]; then
    for name in $names; do run "$name" 1 one; done
else
    cluster_up 2 2 10gbit
fi
# The losses at the last rate's shaping (they do not depend on it).
if [ "$LOSS_STEPS" != 0 ]; then
    for name in $names; do run "$name" "$LOSS_STEPS" loss; done
fi
cluster_down
if [ "$names" = "$all" ] && [ -z "${OUT:-}" ]; then
    python3 scripts/benchmarks_md.py slow-links "$out" "$(nproc)"
fi

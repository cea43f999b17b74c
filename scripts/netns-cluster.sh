#!/usr/bin/env bash
# The emulated cluster test: 2 nodes x 2 ranks as network namespaces on this machine
# (`scripts/cluster.sh`), each link shaped to 1 Gbit/s in both directions. `burn-deepspeed
# launch --mpi 4 --hostfile` runs the GPT example there (TCP over the shaped links between the
# nodes), and its losses must equal those of the same run as 4
# thread ranks (to 1e-5: MPI sums 4 ranks in another order); the bytes that crossed the links
# are printed.
#
#   bash scripts/netns-cluster.sh CLI GPT
#
# Needs root and network namespaces; where they cannot be made, it says why and reports no
# test passed (a skip is not counted as a pass).
set -euo pipefail
cli=${1:?usage: netns-cluster.sh CLI GPT}
gpt=${2:?usage: netns-cluster.sh CLI GPT}
cd "$(dirname "$0")/.."
. scripts/cluster.sh
if ! cluster_check; then
    echo "emulated cluster: skipped: $CLUSTER_SKIP"
    echo "netns cluster: 0 passed, 0 failed"
    exit 0
fi
cluster_up 2 2 1gbit
work=$CLUSTER_WORK
cluster_mpirun_args
launch_args=(--mpi 4 --hostfile "$work/hosts")
for a in "${CLUSTER_ARGS[@]:2}"; do
    launch_args+=("--mpirun-arg=$a")
done
# compare NAME GPT-ARGS...: the run as 4 thread ranks (NAME-threads.json), then as 2 nodes x 2
# MPI ranks (NAME-nodes.json) with the bytes that crossed the links (NAME.bytes).
compare() {
    local name=$1 rc=0 before
    shift
    "$cli" launch --ranks 4 -- "$gpt" "$@" 2> /dev/null | tail -n 1 > "$work/$name-threads.json"
    before=$(cluster_link_bytes)
    CLUSTER_JOB_TIMEOUT=240 cluster_retrying "$name" "$gpt" -- \
        "$cli" launch "${launch_args[@]}" -- "$gpt" "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 20 "$work/$name.err"
        echo "netns cluster: 0 passed, 1 failed"
        exit 1
    fi
    echo $(( $(cluster_link_bytes) - before )) > "$work/$name.bytes"
    tail -n 1 "$work/$name.out" > "$work/$name-nodes.json"
}
compare stage0 --steps 4 --seed 7 --json
# ZeRO++ (quantized weights, secondary partition in nodes of 2, quantized gradients) at
# stage 3, where the nodes are real: OpenMPI's local size and the namespaces agree with
# `zero_hpz_partition_size`, which gives the thread world the same two nodes.
compare zeropp --config examples/gpt/configs/zeropp.json --steps 4 --seed 7 --json
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
load = lambda name: json.load(open(f"{work}/{name}.json"))
passed = 0
for what, name in [("stage 0", "stage0"), ("ZeRO++ stage 3", "zeropp")]:
    a, b = load(f"{name}-threads"), load(f"{name}-nodes")
    sent = int(open(f"{work}/{name}.bytes").read())
    assert b["backend"] == "mpi" and b["world"] == 4, (b["backend"], b["world"])
    worst = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
    print(f"{what}: 4 thread ranks:                            losses {a['losses']}")
    print(f"{what}: 2 nodes x 2 ranks (netns, 1 Gbit/s links): losses {b['losses']}")
    print(f"{what}: max rel diff {worst:.2e}; bytes over the links between the nodes: {sent:,}")
    # MPI's all-reduce of 4 ranks sums in its own order, the thread world in rank order: the
    # losses agree to f32 rounding, not bit for bit (at 2 ranks they are identical).
    ok = len(a["losses"]) == len(b["losses"]) == 4 and worst <= 1e-5 and sent > 0
    passed += ok
print(f"netns cluster: {passed} passed, {2 - passed} failed")
sys.exit(0 if passed == 2 else 1)
PY

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
args=(--steps 4 --seed 7 --json)
"$cli" launch --ranks 4 -- "$gpt" "${args[@]}" 2> /dev/null | tail -n 1 > "$work/threads.json"
cluster_mpirun_args
launch_args=(--mpi 4 --hostfile "$work/hosts")
for a in "${CLUSTER_ARGS[@]:2}"; do
    launch_args+=("--mpirun-arg=$a")
done
before=$(cluster_link_bytes)
rc=0
CLUSTER_JOB_TIMEOUT=240 cluster_retrying nodes "$gpt" -- \
    "$cli" launch "${launch_args[@]}" -- "$gpt" "${args[@]}" || rc=$?
if [ "$rc" -ne 0 ]; then
    tail -n 20 "$work/nodes.err"
    echo "netns cluster: 0 passed, 1 failed"
    exit 1
fi
moved=$(( $(cluster_link_bytes) - before ))
tail -n 1 "$work/nodes.out" > "$work/nodes.json"
python3 - "$work/threads.json" "$work/nodes.json" "$moved" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
moved = int(sys.argv[3])
assert b["backend"] == "mpi" and b["world"] == 4, (b["backend"], b["world"])
print(f"4 thread ranks:                            losses {a['losses']}")
print(f"2 nodes x 2 ranks (netns, 1 Gbit/s links): losses {b['losses']}")
worst = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
print(f"max rel diff {worst:.2e}; bytes over the links between the nodes: {moved:,}")
# MPI's all-reduce of 4 ranks sums in its own order, the thread world in rank order: the
# losses agree to f32 rounding, not bit for bit (at 2 ranks they are identical).
ok = len(a["losses"]) == len(b["losses"]) == 4 and worst <= 1e-5 and moved > 0
print("netns cluster: 1 passed, 0 failed" if ok else "netns cluster: 0 passed, 1 failed")
sys.exit(0 if ok else 1)
PY

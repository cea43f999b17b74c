#!/usr/bin/env bash
# Regenerates the 1-bit and PLD section of BENCHMARKS.md:
# - 1-bit Adam / 1-bit LAMB against Adam (AdamW mode) / LAMB: GPT `tiny`, 2 ranks, STEPS
#   steps with freeze_step at 20%; last-20 mean losses and bytes sent per rank;
# - progressive layer dropping: `pld_bench` (with and without PLD interleaved in one process),
#   time per sample from step PLD_FROM on and the losses beside it.
# Results stay in $CARGO_TARGET_DIR/bench-onebit (default target/): RUNS (default: all four
# optimizer runs) and PLD=0 re-run a part and reuse the other results there.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS="${STEPS:-400}"
PLD_STEPS="${PLD_STEPS:-2200}"
PLD_FROM="${PLD_FROM:-2000}"
RUNS="${RUNS:-default onebit_adam lamb onebit_lamb}"
PLD="${PLD:-1}"
cargo build --release --example gpt --example pld_bench
bin="${CARGO_TARGET_DIR:-target}/release/examples"
out="${CARGO_TARGET_DIR:-target}/bench-onebit"
mkdir -p "$out"
freeze=$((STEPS / 5))
for name in $RUNS; do
    cfg="examples/gpt/configs/$name.json"
    if [[ $name == onebit_* ]]; then
        # freeze_step at 20% of the run.
        python3 - "$cfg" "$freeze" > "$out/$name.cfg.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["optimizer"]["params"]["freeze_step"] = int(sys.argv[2])
print(json.dumps(c))
PY
        cfg="$out/$name.cfg.json"
    fi
    echo "== $name ($STEPS steps, 2 ranks)" >&2
    "$bin/gpt" --config "$cfg" --ranks 2 --steps "$STEPS" --json | tail -n 1 > "$out/$name.json"
done
if [[ $PLD != 0 ]]; then
    echo "== PLD ($PLD_STEPS steps, timed from $PLD_FROM)" >&2
    "$bin/pld_bench" --steps "$PLD_STEPS" --measure-from "$PLD_FROM" --json | tail -n 1 \
        > "$out/pld.json"
fi
python3 scripts/benchmarks_md.py onebit "$out" "$freeze" "$(nproc)"

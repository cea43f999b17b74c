"""The `overlap` and `overlap3` sections of BENCHMARKS.md (prose: templates/overlap*.md)."""
import json
from statistics import median
from pathlib import Path

from .common import paired_rounds, render


def per_round(t, row):
    """The thread run's tokens/s round by round for `row` (0: off, 1: on)."""
    return ", ".join(f"{x:.0f}" for x in t["rows"][row]["tokens_per_s_rounds"])


def overlap(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads.json"))
    rows = []
    off_tps = t["rows"][0]["tokens_per_s"]
    for row in t["rows"]:
        ratio = "1.00" if row["overlap_comm"] == "off" else f"{t['ratio_on_over_off']:.3f}"
        diff = f"{t['max_loss_diff']:.1e}" if row["overlap_comm"] == "on" else ""
        rows.append(
            f"| threads | | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{row['accumulate_ms_per_step']:.1f} | "
            f"{row['peak_model_state_bytes_per_rank'] / 1e6:.1f} | {diff} |"
        )
    seq = 256 if t["model"] == "small" else 128

    def timed(r):
        secs = [s * r["train_batch_size"] for s in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for y, polling in [(0, "busy (default)"), (1, "`mpi_yield_when_idle`")]:
        runs = {}
        for ov in ["false", "true"]:
            runs[ov] = [
                json.load(open(f))
                for f in sorted(d.glob(f"mpi-yield{y}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
        if not runs["false"] or not runs["true"]:
            continue
        # Paired by round: on over off within the same round.
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            acc = median(
                max(b["accumulate"] for b in r["breakdown_per_rank"]) for r in rs
            )
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            peak = rs[-1]["peak_model_state_bytes_per_rank"] / 1e6
            rows.append(
                f"| `mpirun -n 2` | {polling} | {name} | {tps:.0f} | {ratio} | {acc:.1f} | "
                f"{peak:.1f} | {'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    return render(
        "overlap", t=t, cores=cores, timed_steps=t["steps"] - 1, rows="\n".join(rows),
        mpi_ratios="; ".join(
            f"{k}: " + ", ".join(f"{x:.3f}" for x in v) for k, v in ratios.items()
        ),
        off_rounds=per_round(t, 0),
        on_rounds=per_round(t, 1),
        off_tps=off_tps,
    )


def overlap3(directory, cores):
    d = Path(directory)
    t = json.load(open(d / "threads3.json"))
    seq = 256 if t["model"] == "small" else 128
    rows = []
    for row in t["rows"]:
        on = row["overlap_comm"] == "on"
        ratio = f"{t['ratio_on_over_off']:.3f}" if on else "1.00"
        ahead = t.get("gathered_ahead") if on else 0
        diff = f"{t['max_loss_diff']:.1e}" if on else ""
        rows.append(
            f"| threads | {row['overlap_comm']} | {row['tokens_per_s']:.0f} | {ratio} | "
            f"{ahead} | {diff} |"
        )

    def timed(r):
        secs = [x * r["train_batch_size"] for x in r["step_seconds_per_sample"][1:]]
        return len(secs) * r["train_batch_size"] * seq / sum(secs)

    ratios = {}
    for prefix, polling in [("mpi3", "busy (default)"), ("mpi3y", "`mpi_yield_when_idle`")]:
        runs = {
            ov: [
                json.load(open(f))
                for f in sorted(d.glob(f"{prefix}-{ov}-*.json"))
                if f.stat().st_size > 0
            ]
            for ov in ["false", "true"]
        }
        if not runs["false"] or not runs["true"]:
            continue
        paired, diff = paired_rounds(runs, timed)
        ratios[polling] = paired
        for ov in ["false", "true"]:
            rs = runs[ov]
            tps = median(timed(r) for r in rs)
            name = "on" if ov == "true" else "off"
            ratio = "1.00" if ov == "false" else f"{median(paired):.3f}"
            ahead = rs[-1]["gather_stats"]["gathered_ahead"]
            rows.append(
                f"| `mpirun -n 2`, {polling} | {name} | {tps:.0f} | {ratio} | {ahead} | "
                f"{'' if ov == 'false' else f'{diff:.1e}'} |"
            )
    return render(
        "overlap3", t=t, cores=cores, timed_steps=t["steps"] - 1, rows="\n".join(rows),
        off_rounds=per_round(t, 0),
        on_rounds=per_round(t, 1),
        mpi_ratios="".join(
            f"; `mpirun` ({k}), on/off within each round: " + ", ".join(f"{x:.3f}" for x in v)
            for k, v in ratios.items()
        ),
    )

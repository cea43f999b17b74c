"""The `device-flex` section of BENCHMARKS.md (prose: templates/device-flex.md)."""
import json

from .common import render


def device_flex(out, rounds, rev, cores):
    """Flex before and after the device-resident regimes: `scripts/bench-zero-compare.sh`."""
    rounds = int(rounds)

    def speeds(side):
        by_stage = {}
        for r in range(1, rounds + 1):
            for row in json.load(open(f"{out}/{side}-bench-{r}.json"))["rows"]:
                by_stage.setdefault(row["stage"], []).append(row["tokens_per_s"])
        return {s: sum(v) / len(v) for s, v in by_stage.items()}

    before, after = speeds("before"), speeds("after")
    rows = []
    for s in sorted(before):
        lb = json.load(open(f"{out}/before-gpt-stage{s}.json"))["losses"]
        la = json.load(open(f"{out}/after-gpt-stage{s}.json"))["losses"]
        same = "yes" if lb == la else f"no: {lb} vs {la}"
        rows.append(
            f"| {s} | {before[s]:.0f} | {after[s]:.0f} | {after[s] / before[s]:.3f} | {same} |"
        )
    return render("device-flex", rev=rev, rounds=rounds, cores=cores, rows="\n".join(rows))


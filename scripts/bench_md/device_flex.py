"""The `device-flex` and `redesign-flex` sections of BENCHMARKS.md: two builds of the ZeRO
benchmark interleaved in one session (prose: templates/device-flex.md, redesign-flex.md)."""
import json

from .common import render


def device_flex(out, rounds, rev, cores, section="device-flex"):
    """Flex before and after a change (`scripts/bench-zero-compare.sh`); `section` names the
    change's section and template."""
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
    return render(section, rev=rev, rounds=rounds, cores=cores, rows="\n".join(rows))


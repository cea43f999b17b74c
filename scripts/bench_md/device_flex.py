"""The `device-flex` section of BENCHMARKS.md."""
import json


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
    lines = [
        "## Training on the model's device: Flex before and after",
        "",
        f"`bash scripts/bench-zero-compare.sh {rev}` (`ROUNDS={rounds}`): the ZeRO benchmark of",
        f"`{rev}` (the last commit before the device-resident regimes) and of this checkout,",
        "built side by side and interleaved round by round in one session on GPT `small`, world 2,",
        f"{cores} cores; tokens/s averaged over the rounds. Flex keeps the host regimes, so the",
        "losses of GPT `small` trained 3 steps at each stage by both binaries must be identical.",
        "",
        "| stage | before tokens/s | after tokens/s | after / before | losses bit-identical |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(before):
        lb = json.load(open(f"{out}/before-gpt-stage{s}.json"))["losses"]
        la = json.load(open(f"{out}/after-gpt-stage{s}.json"))["losses"]
        same = "yes" if lb == la else f"no: {lb} vs {la}"
        lines.append(
            f"| {s} | {before[s]:.0f} | {after[s]:.0f} | {after[s] / before[s]:.3f} | {same} |"
        )
    return "\n".join(lines) + "\n\n"


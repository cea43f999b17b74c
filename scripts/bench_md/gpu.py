"""The `gpu` section of BENCHMARKS.md (prose: templates/gpu*.md)."""
import json
from pathlib import Path

from .common import compared, last_json, max_rel, render, steady_tokens, test_counts


def gpu(directory):
    d = Path(directory)
    name = (d / "gpu.txt").read_text().strip()
    cores = (d / "cores.txt").read_text().strip() if (d / "cores.txt").exists() else "?"
    # `bench-gpu.sh flex` writes where the Flex references ran when not beside the GPU runs.
    flex_host = d / "flex-host.txt"
    flex_where = (
        f"on another machine: {flex_host.read_text().strip()}"
        if flex_host.exists()
        else f"with the same binary on its {cores} CPU cores"
    )
    rows = []
    for ranks, stages in [(2, [0, 1, 2, 3]), (1, [0, 3])]:
        for stage in stages:
            tag = "" if ranks == 2 else "-r1"
            c = last_json(d / f"tiny-cuda{tag}-s{stage}.out")
            f = last_json(d / f"tiny-flex{tag}-s{stage}.out")
            if c is None or f is None:
                rows.append(f"| {ranks} | {stage} | | | | did not run | | |")
                continue
            worst = max_rel(f["losses"], c["losses"])
            via = "NCCL" if ranks == 1 else "host-staged"
            rows.append(
                f"| {ranks} | {stage} | {via} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
                f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {worst:.1e} "
                f"| {max(c['host_device_bytes_per_step']):,} "
                f"| {max(c['staged_collective_bytes_per_step']):,} |"
            )
    parts = [render(
        "gpu", name=name, flex_where=flex_where, kernel_tests=test_counts(d / "kernels-tests.out"),
        strategy_tests=test_counts(d / "strategies-tests.out"), rows="\n".join(rows),
    )]
    o = last_json(d / "overhead-small.out")
    if o:
        phases = lambda ms: {
            **{p: ms.get(p, 0) for p in ("forward", "backward", "optimizer")}, "step": ms["step"]
        }
        parts.append(render(
            "gpu-overhead", o=o, runs=len(o["rounds"]), plain=phases(o["plain_ms_per_step"]),
            engine=phases(o["engine_ms_per_step"]),
        ))
    for model in ["small", "medium"]:
        runs = [(st, last_json(d / f"{model}-cuda-s{st}.out")) for st in range(4)]
        if not any(r for _, r in runs):
            continue

        def steady(r):
            return steady_tokens(r, 256)

        base = next(steady(r) for _, r in runs if r)
        first = next(r for _, r in runs if r)
        rows = []
        for stage, r in runs:
            if r is None:
                rows.append(f"| {stage} | did not run | | | | | |")
                continue
            rows.append(
                f"| {stage} | {steady(r):.0f} | {steady(r) / base:.2f} | {r['tokens_per_s']:.0f} "
                f"| {r['losses'][-1]:.4f} | {r['model_state_bytes_per_rank']:,} "
                f"| {max(r['host_device_bytes_per_step']):,} |"
            )
        parts.append(render("gpu-stages", model=model, params=first["params"],
                            steps=len(first["losses"]), rows="\n".join(rows)))
    offloaded = [(st, last_json(d / f"small-cuda-s{st}-resident.out"),
                  last_json(d / f"small-cuda-s{st}-offload.out"))
                 for st in [2, 3]]
    if any(o for _, _, o in offloaded):
        rows = []
        for stage, r, o, worst in compared(offloaded):
            what = "optimizer" + (" + parameters" if stage == 3 else "")
            for name, x in [("no", r), (what, o)]:
                ratio = steady_tokens(x, 256) / steady_tokens(r, 256)
                rows.append(
                    f"| {stage} | {name} | {steady_tokens(x, 256):.0f} | {ratio:.2f} "
                    f"| {max(x['host_device_bytes_per_step']):,} "
                    f"| {x['model_state_bytes_per_rank']:,} | {'' if x is r else f'{worst:.1e}'} |"
                )
        parts.append(render("gpu-offload", rows="\n".join(rows)))
    mixed = [(t, last_json(d / f"tiny-cuda-{t}.out"), last_json(d / f"tiny-flex-{t}.out"))
             for t in ["fp16", "fp16-scale8", "bf16"]]
    if any(c and f for _, c, f in mixed):
        rows = [
            f"| {t} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
            f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {worst:.1e} "
            f"| {f['skipped_steps']}, {c['skipped_steps']} "
            f"| {max(c['host_device_bytes_per_step']):,} |"
            for t, f, c, worst in compared((t, f, c) for t, c, f in mixed)
        ]
        parts.append(render("gpu-mixed", rows="\n".join(rows)))
    onebit = [((opt, ranks), last_json(d / f"tiny-flex-onebit-{opt}-r{ranks}.out"),
               last_json(d / f"tiny-cuda-onebit-{opt}-r{ranks}.out"))
              for opt in ["adam", "lamb"] for ranks in [2, 1]]
    onebit.append((("pipeline", 2), last_json(d / "tiny-flex-pipeline.out"),
                   last_json(d / "tiny-cuda-pipeline.out")))
    if any(c for _, _, c in onebit):
        rows = []
        for (opt, ranks), f, c, worst in compared(onebit):
            dense = "" if opt == "pipeline" else f"{max_rel(f['losses'][:8], c['losses'][:8]):.1e}"
            via = "NCCL" if ranks == 1 else "host-staged"
            b = c["host_device_bytes_per_step"]
            name = "pipeline" if opt == "pipeline" else f"1-bit {opt.capitalize() if opt == 'adam' else 'LAMB'}"
            rows.append(
                f"| {name} | {ranks} | {via} | {f['losses'][0]:.4f}, {f['losses'][-1]:.4f} "
                f"| {c['losses'][0]:.4f}, {c['losses'][-1]:.4f} | {dense} | {worst:.1e} "
                f"| {b[0]:,}, {b[-1]:,} |"
            )
        parts.append(render("gpu-onebit", rows="\n".join(rows)))
    k = last_json(d / "kernel-bench.out")
    if k and "device" in k:
        t = last_json(d / "torch-copy.out") or (
            json.load(open(d / "torch-copy.json")) if (d / "torch-copy.json").exists() else None
        )
        torch_row = (
            f"| PyTorch {t['torch']} `copy_` of {t['bytes'] // 2**30} GiB read and written "
            f"(same machine, another process) | {t['gbps']:.0f} | AdamW at "
            f"{k['device_adamw_gbps'] / t['gbps']:.2f} of it |"
            if t else ""
        )
        parts.append(render("gpu-kernel", k=k, torch_row=torch_row))
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"

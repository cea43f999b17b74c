"""The GPT example's model in PyTorch, trained under DDP or DeepSpeed on CPU with gloo.

It mirrors `examples/gpt` layer by layer (byte vocabulary of 256, token and position
embeddings, pre-LN blocks with a fused q/k/v projection, an additive causal mask, exact GELU,
a final LayerNorm and an untied head) and its data (the embedded corpus, windows drawn with
the same SplitMix64 offsets, so step s sees the same sequences as ours), with the default
config's AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.01, WarmupLR over 20 steps,
clipping at 1.0) and global batch of 16 sequences.

    python scripts/bench_vs_pytorch.py --impl ddp --world 2 --model tiny --steps 40
    python scripts/bench_vs_pytorch.py --impl deepspeed --stage 2 --world 2 --model small

It prints one JSON line: the median tokens/s of the steps after the warm-up, and the
processes' peak RSS. `scripts/bench-vs-pytorch.sh` runs it beside our example.
"""

import argparse
import json
import math
import os
import queue
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {
    "tiny": dict(d=128, layers=4, heads=4, seq=128),
    "small": dict(d=256, layers=8, heads=8, seq=256),
}
MASK64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def offset(corpus_len, seed, step, index, seq):
    """`ByteCorpus::offset`: the start of sequence `index` of step `step`'s global batch."""
    span = corpus_len - seq - 1
    s = seed ^ ((step * 0xD1B54A32D192ED03) & MASK64) ^ ((index * 0x8CB92BA72F3D8DD7) & MASK64)
    return splitmix64(s) % (span + 1)


def batch(corpus, seed, step, first, micro, seq):
    rows = [corpus[o : o + seq + 1] for o in (offset(len(corpus), seed, step, first + i, seq) for i in range(micro))]
    data = torch.tensor([list(r) for r in rows], dtype=torch.long)
    return data[:, :-1], data[:, 1:]


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, 4 * d)
        self.mlp_out = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=2)
        q, k, v = (z.reshape(b, t, h, dh).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(dh) + mask
        att = torch.softmax(scores, dim=-1) @ v
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))


class Gpt(nn.Module):
    def __init__(self, d, layers, heads, seq):
        super().__init__()
        self.tok_emb = nn.Embedding(256, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        mask = torch.triu(torch.full((seq, seq), -1e9), diagonal=1)
        self.register_buffer("mask", mask.reshape(1, 1, seq, seq), persistent=False)

    def forward(self, inputs, targets):
        b, t = inputs.shape
        x = self.tok_emb(inputs) + self.pos_emb(torch.arange(t).expand(b, t))
        mask = self.mask[:, :, :t, :t]
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(b * t, 256), targets.reshape(b * t))


def lr_at(step):
    """WarmupLR, linear from 0 to 1e-3 over 20 steps (the example's default config)."""
    return 1e-3 * min(step / 20, 1.0)


def worker(rank, args, corpus, port, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.world),
    )
    torch.set_num_threads(args.threads)
    torch.manual_seed(5)
    shape = SHAPES[args.model]
    model = Gpt(**shape)
    micro = 16 // args.world
    if args.impl == "ddp":
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
        model = nn.parallel.DistributedDataParallel(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

        def train(inputs, targets, step):
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            start = time.perf_counter()
            loss = model(inputs, targets)
            value = loss.item()
            forward = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            backward = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            done = time.perf_counter()
            return value, (forward - start, backward - forward, done - backward)

    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_clipping": 1.0,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20, "warmup_type": "linear"},
            },
            "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 5e5},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def train(inputs, targets, step):
            start = time.perf_counter()
            loss = engine(inputs, targets)
            value = loss.item()
            forward = time.perf_counter()
            engine.backward(loss)
            backward = time.perf_counter()
            engine.step()
            done = time.perf_counter()
            return value, (forward - start, backward - forward, done - backward)

    times, losses, phases = [], [], []
    for step in range(args.steps):
        inputs, targets = batch(corpus, args.seed, step, rank * micro, micro, shape["seq"])
        dist.barrier()
        start = time.perf_counter()
        loss, split = train(inputs, targets, step)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        phases.append(split)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put((rank, times, losses, rss, phases))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ddp", "deepspeed"], default="ddp")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=list(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warm-up", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=0, help="threads per rank (0: cores / world)")
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "examples", "gpt", "data", "corpus.txt"))
    p.add_argument("--port", type=int, default=29517)
    args = p.parse_args()
    if args.threads == 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.world)
    with open(args.corpus, "rb") as f:
        corpus = f.read()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, corpus, args.port, out)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    # A rank that fails leaves the others blocked in a collective: wait for the results
    # while every rank lives, and stop them all when one has died.
    results = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                sys.exit(f"a rank failed with exit code {dead[0]}")
    results.sort(key=lambda r: r[0])
    for proc in procs:
        proc.join()
    # A step ends when its slowest rank ends: the step time is the largest over ranks.
    steps = [max(r[1][s] for r in results) for s in range(args.steps)]
    steady = steps[args.warm_up :]
    seq = SHAPES[args.model]["seq"]
    # Rank 0's median milliseconds per step in forward (with the loss read back), backward
    # (DDP's all-reduce overlaps it; DeepSpeed's reduces in `engine.backward` at stages 1-2)
    # and the step (clipping and the optimizer; DeepSpeed's stage-3 gathers too).
    split = results[0][4][args.warm_up :]
    phase_ms = {
        name: 1e3 * statistics.median(s[i] for s in split)
        for i, name in enumerate(["forward", "backward", "step"])
    }
    versions = {"torch": torch.__version__}
    if args.impl == "deepspeed":
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    print(
        json.dumps(
            {
                "impl": args.impl if args.impl == "ddp" else f"deepspeed-{args.stage}",
                "model": args.model,
                "world": args.world,
                "threads_per_rank": args.threads,
                **versions,
                "phase_ms": phase_ms,
                "tokens_per_s": 16 * seq / statistics.median(steady),
                "losses": results[0][2],
                "peak_rss_bytes": max(r[3] for r in results),
            }
        )
    )


if __name__ == "__main__":
    main()

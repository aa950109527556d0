"""One rank's DDP step on a GPT-2-small-sized transformer with and without gradcomp's hook: step
times side by side, codec time per step, and from a profiler trace how much of gradcomp's kernel
time ran while backward kernels ran on other streams (W = 1 over NCCL on a GPU; --device cpu runs
a tiny model over Gloo to check the script itself).

    python bench/gpu_overlap.py --out build-gpu/out/overlap.json
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt

from timeline import intersect, length, union  # bench/, beside this script


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.pos))


def kernel_overlap(trace_path: str) -> dict:
    """gradcomp's kernels against the other streams' kernels in a chrome trace."""
    events = json.load(open(trace_path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    ours = [e for e in kernels if "gradcomp" in e["name"] or "q4_" in e["name"] or "topk_" in e["name"]]
    our_streams = {e["args"].get("stream") for e in ours}
    others = [e for e in kernels if e["args"].get("stream") not in our_streams]
    a = union([(e["ts"], e["ts"] + e["dur"]) for e in ours])
    b = union([(e["ts"], e["ts"] + e["dur"]) for e in others])
    codec_us, overlapped_us = length(a), length(intersect(a, b))
    return {"gradcomp_kernels": len(ours), "gradcomp_streams": sorted(str(s) for s in our_streams),
            "other_kernels": len(others), "gradcomp_kernel_us": codec_us, "overlapped_us": overlapped_us,
            "overlap_fraction": overlapped_us / codec_us if codec_us else None}


def run(args) -> dict:
    cuda = args.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = Transformer(args.vocab, args.d, args.layers, args.heads, args.seq).to(dev)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    results = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "params": params,
               "date": datetime.date.today().isoformat(), "torch": torch.__version__, "methods": {}}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step(ddp, opt):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()

    for method in args.methods.split(","):
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        hook = None
        if method == "gradcomp-q4":
            hook = gt.register(ddp, gradcomp.Q4())
        elif method == "gradcomp-topk":
            hook = gt.register(ddp, gradcomp.TopK(ratio=0.01))
        elif method == "bf16-hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif method != "ddp":
            raise SystemExit(f"unknown method {method}")
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        for _ in range(args.warmup):
            step(ddp, opt)
        sync()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(ddp, opt)
            sync()
            times.append(time.perf_counter() - t0)
        row = {"median_step_ms": 1e3 * statistics.median(times), "min_step_ms": 1e3 * min(times)}
        if hook is not None:
            total = hook.stats()["total"]
            row["codec_ms_per_step"] = 1e3 * total["codec_seconds"] / (args.warmup + args.steps)
            row["buckets_per_step"] = total["buckets"] / (args.warmup + args.steps)
            row["stats_total"] = total
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    step(ddp, opt)
                sync()
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(path)
                row["trace"] = kernel_overlap(path)
        results["methods"][method] = row
        del ddp, opt, hook
        gc.collect()
    base = results["methods"].get("ddp", {}).get("median_step_ms")
    for row in results["methods"].values():
        if base:
            row["vs_ddp"] = row["median_step_ms"] / base
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", default="ddp,bf16-hook,gradcomp-q4,gradcomp-topk")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    store = tempfile.mktemp(prefix="gradcomp-overlap-")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.FileStore(store, 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        results = run(args)
    finally:
        dist.destroy_process_group()
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

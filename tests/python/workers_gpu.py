"""Per-rank bodies of the GPU tests of the hook (NCCL), run by scripts/gpu_check.sh."""
from __future__ import annotations

import json
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

from workers_common import codec, flat, grad


def gpu_hook_matches_cpu(rank, world, codec_name):
    """On one GPU (NCCL, world 1) the hook's averaged buckets equal the CPU hook's bit for bit."""
    results = {}
    torch.cuda.set_device(0)  # NCCL's communicator binds to the current device when first used
    for device in ("cpu", "cuda"):
        group = dist.new_group(backend="gloo" if device == "cpu" else "nccl")
        core = _C.DdpHook(group, codec(codec_name)._options())
        out = []
        for step in range(3):
            bucket = grad(rank, step, 10007).to(device)
            core.reduce_bucket(bucket, 0, [[10007]])
            out.append(bucket.cpu())
        results[device] = out
    for a, b in zip(results["cpu"], results["cuda"]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "CUDA hook differs from CPU hook"
    return True


def gpu_ddp_trains(rank, world):
    """DDP with the hook on a GPU: trains, and the trace shows q4 encode kernels on a stream of
    their own running at the same time as backward GEMMs (one bucket per layer, so a bucket's
    encode can overlap the backward of the layers before it)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*layers).cuda()
    group = dist.new_group(backend="nccl")
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=8)
    hook = gt.register(ddp, gradcomp.Q4())
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(512, 2048, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
    assert torch.isfinite(flat(ddp)).all() and hook.stats()["total"]["buckets"] >= 5
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    encode = [e for e in kernels if "q4_encode_kernel" in e["name"]]
    gemm = [e for e in kernels if "gemm" in e["name"].lower() or "sm90" in e["name"].lower()]
    assert encode, "no q4 encode kernel in the CUDA trace"
    encode_streams = {e["args"]["stream"] for e in encode}
    gemm_streams = {e["args"]["stream"] for e in gemm}
    assert gemm and not (encode_streams & gemm_streams), \
        f"encode kernels on stream(s) {encode_streams}, GEMMs on {gemm_streams}"
    overlapping = [(a["name"], b["name"]) for a in encode for b in gemm
                   if a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]]
    assert overlapping, "no q4 encode kernel ran at the same time as a GEMM"
    return True

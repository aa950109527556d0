"""Per-rank bodies of the tests that run on any device, CUDA included: several processes sharing
one GPU over Gloo (NCCL refuses two ranks on one GPU), or the CPU."""
from __future__ import annotations

import torch
import torch.nn as nn

from workers_common import MLP, codec, flat, hook_on_route


def _device(device: str) -> torch.device:
    return torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")


def routes_agree_under_autocast(rank, world, device, codec_name, amp):
    """DDP on `device` trained by both routes (bf16 autocast with a GradScaler when `amp`) gives
    bit-identical models; a NaN on the last rank at step 3 makes every rank skip that step and
    report the bucket as non-finite."""
    dev = _device(device)
    runs = []
    for route in ("register", "standard"):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(MLP(dims=(64, 256, 256, 10)).to(dev), bucket_cap_mb=1)
        hook = hook_on_route(ddp, route, codec(codec_name))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler(dev.type, init_scale=1024.0, enabled=amp)
        runs.append((ddp, hook, opt, scaler))
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        if step == 3 and rank == world - 1:
            x[0, 0] = float("nan")
        x, y = x.to(dev), y.to(dev)
        before = [flat(ddp).clone() for ddp, _, _, _ in runs]
        for ddp, hook, opt, scaler in runs:
            opt.zero_grad()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                loss = nn.functional.cross_entropy(ddp(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        a, b = flat(runs[0][0]), flat(runs[1][0])
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
            f"step {step}: routes differ by {(a - b).abs().max().item()}"
        if step == 3:
            for (ddp, hook, _, _), prior in zip(runs, before):
                assert hook.stats()["step"]["nonfinite_buckets"] >= 1, hook.stats()["step"]
                if amp:
                    assert torch.equal(flat(ddp), prior), "the scaler took a step with a NaN on one rank"
        if step == 3 and not amp:  # without a scaler the NaN reaches the weights: nothing to train on
            return True
    assert torch.isfinite(flat(runs[0][0])).all()
    stats = runs[0][1].stats()["total"]
    assert stats["buckets"] > 0 and stats["bytes_sent"] > 0, stats
    return True

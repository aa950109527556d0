"""Per-rank body of the FP8 baseline's test."""
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from fp8_hook import BLOCK, fp8_allreduce_mean, fp8_hook  # noqa: E402


def fp8_mean_and_training(rank, world):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10_001, generator=g) * (1 + rank)
    mean = x.clone()
    dist.all_reduce(mean)
    mean /= world
    got = fp8_allreduce_mean(x)
    # Two e4m3 roundings (3 mantissa bits: relative error <= 2^-4 each) of values at most a block's
    # largest magnitude, which is at most the largest input's over the ranks.
    bound = 2 * 2.0 ** -4 * (1 + world) * x.abs().max() * 1.0001
    assert got.shape == x.shape and (got - mean).abs().max() <= bound, (got - mean).abs().max()
    assert (got - mean).abs().max() > 0  # it did quantize
    assert BLOCK == 128
    data = torch.Generator().manual_seed(100 + rank)
    xs, ys = torch.randn(64, 16, generator=data), torch.randint(0, 4, (64,), generator=data)
    final = {}
    for hooked in (False, True):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        if hooked:
            ddp.register_comm_hook(None, fp8_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for _ in range(60):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(xs), ys)
            loss.backward()
            opt.step()
        final[hooked] = loss.item()
    # It trains as plain DDP does (the same data and start), within FP8's noise.
    assert final[False] < 1.2 and abs(final[True] - final[False]) < 0.02 * final[False], final
    return True


def powersgd_with_ddps_buckets(rank, world):
    """PyTorch's PowerSGD hook with DDP's normal buckets on Gloo, a process group per bucket index
    (bench/powersgd_buckets.py): several buckets compress, the ranks keep identical parameters."""
    from powersgd_buckets import register_powersgd_per_bucket

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)], nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    states = register_powersgd_per_bucket(ddp, rank=2, start_iter=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(12):
        x, y = torch.randn(32, 64, generator=data), torch.randint(0, 4, (32,), generator=data)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    compressed = [i for i, s in enumerate(states) if s.p_memory_dict]
    assert len(compressed) >= 3, f"only buckets {compressed} compressed"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone), "ranks' parameters differ"
    return len(compressed)

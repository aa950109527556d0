"""Per-rank body of the Prometheus test: DDP with the q4 hook serving its metrics while it trains,
one rank made slow on purpose, until the test says stop."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt


def train_and_serve(rank, world, port, control, slow_rank, slow_seconds, slow_after=0.0):
    """Serves metrics on port + rank; trains until `control`/stop exists (rank 0 decides for all),
    sleeping `slow_seconds` before each backward on `slow_rank`; then writes its stats to
    `control`/stats.<rank>.json and serves until `control`/done exists. The slowness starts
    `slow_after` seconds in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = gt.register(ddp, gradcomp.Q4())
    gt.metrics.serve(port + rank, hook, addr="127.0.0.1", per_rank_port=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    begin = time.time()
    deadline = begin + 150 + slow_after
    steps = 0
    while True:
        stop = torch.tensor([1.0 if (os.path.exists(os.path.join(control, "stop")) or time.time() > deadline)
                             else 0.0])
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        if rank == slow_rank and time.time() - begin >= slow_after:
            time.sleep(slow_seconds)
        loss.backward()
        opt.step()
        steps += 1
    dist.barrier()
    with open(os.path.join(control, f"stats.{rank}.json"), "w") as f:
        json.dump({"total": hook.stats()["total"], "steps": steps}, f)
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(control, "done")) and time.time() < deadline:
        time.sleep(0.2)
    return steps

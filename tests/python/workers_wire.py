"""Per-rank bodies of the wire-byte tests: each front end's bytes_sent against the TCP bytes this
process's Gloo sockets put on the wire over the same steps (the kernel's tcp_info, read by `ss`)."""
from __future__ import annotations

import os
import re
import subprocess
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import gradcomp
import gradcomp.torch as gt

_SOCKET = re.compile(r"pid=(\d+),")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RETRANS = re.compile(r"\bbytes_retrans:(\d+)")


def tcp_bytes_sent(pid: int | None = None) -> int:
    """Bytes this process's established TCP sockets have sent, retransmissions excluded. The launcher's
    ranks meet through a FileStore, so every such socket is one of Gloo's pairs."""
    pid = os.getpid() if pid is None else pid
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line; its tcp_info follows on an indented line
            owners = {int(p) for p in _SOCKET.findall(line)}
            mine = pid in owners
        elif mine:
            sent = _SENT.search(line)
            retrans = _RETRANS.search(line)
            total += (int(sent.group(1)) if sent else 0) - (int(retrans.group(1)) if retrans else 0)
    return total


def settled_tcp_bytes_sent() -> int:
    """tcp_bytes_sent once the last collective's bytes have left (a collective returns when this rank's
    part is done; its last send may still be queued in the kernel for a moment)."""
    time.sleep(0.3)
    return tcp_bytes_sent()


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 100), nn.ReLU(), nn.Linear(100, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 300, generator=g), torch.randint(0, 10, (32,), generator=g)


def ddp_hook(rank, world, codec_name):
    codec = gradcomp.Q4() if codec_name == "q4" else gradcomp.TopK(ratio=0.05)
    ddp = nn.parallel.DistributedDataParallel(model())
    hook = gt.register(ddp, codec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step(t):
        x, y = batch(rank, t)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    step(0)  # the first step also agrees on the bucket layout
    before, counted = settled_tcp_bytes_sent(), hook.stats()["total"]["bytes_sent"]
    for t in range(1, 4):
        step(t)
    return settled_tcp_bytes_sent() - before, hook.stats()["total"]["bytes_sent"] - counted


def fsdp(rank, world):
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    hook = gt.fsdp(m, gradcomp.Q4())

    def step(t):
        x, y = batch(rank, t)
        nn.functional.cross_entropy(m(x), y).backward()

    step(0)
    # From here parameters stay unsharded, so the steps measured carry no all-gather of FSDP's own:
    # only the reduce-scatters, which are gradcomp's.
    for module in m.modules():
        if hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(False)
            module.set_reshard_after_forward(False)
    step(1)  # all-gathers once more, then keeps the parameters unsharded
    before, counted = settled_tcp_bytes_sent(), hook.stats()["total"]["bytes_sent"]
    for t in range(2, 5):
        step(t)
    return settled_tcp_bytes_sent() - before, hook.stats()["total"]["bytes_sent"] - counted


def diloco(rank, world):
    m = model(seed=rank)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sync = gt.diloco(m, opt, gradcomp.Q4(), inner_steps=2)

    def step(t):
        x, y = batch(rank, t)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()  # DiLoCo syncs on every second one

    step(0)
    step(1)  # the first round
    before, counted = settled_tcp_bytes_sent(), sync.stats()["bytes_sent"]
    for t in range(2, 8):
        step(t)
    return settled_tcp_bytes_sent() - before, sync.stats()["bytes_sent"] - counted

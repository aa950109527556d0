"""Per-rank bodies of the safety tests: crafted checkpoints, where the metrics listen."""
from __future__ import annotations

import io
import os
import pathlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import gradcomp
import gradcomp.torch as gt


class RunsCode:
    """Unpickling this creates `marker`: what a crafted checkpoint would do with a shell instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def crafted_checkpoint(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save({"format": 1, "kind": "gradcomp_fsdp", "reduce_scatter": RunsCode(marker)}, buffer)
    return buffer.getvalue()


def fsdp_refuses_a_pickle_that_runs_code(rank, world, marker):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    hook = gt.fsdp(model, gradcomp.Q4())
    try:
        hook.load_state_dict({f"rank{rank}": crafted_checkpoint(marker)})
    except Exception as e:  # torch's UnpicklingError: the global is not allowed under weights_only
        refused = f"{type(e).__name__}: {e}"
    else:
        refused = ""
    return refused, os.path.exists(marker)


def serve_binds(rank, world, port, addr):
    """Serves a DDP hook's metrics with serve's default address (addr None) or `addr`; returns the
    local addresses listening on `port`, from /proc/net/tcp (the kernel's own table)."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    hook = gt.register(ddp, gradcomp.Q4())
    if addr is None:
        gt.metrics.serve(port, hook, per_rank_port=False)
    else:
        gt.metrics.serve(port, hook, addr=addr, per_rank_port=False)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                listening.append(host)
    return listening


def one_native_hook_under_concurrent_scrapes(rank, world):
    """Two threads scrape a HookState before its first bucket; the native hook's constructor is
    slowed so that both would pass an unguarded "is it made yet" check."""
    import threading
    import time

    from gradcomp import ddp

    made = []
    real = ddp._C.DdpHook

    def slow(*args):
        time.sleep(0.3)
        made.append(1)
        return real(*args)

    ddp._C.DdpHook = slow
    try:
        state = gt.HookState(gradcomp.Q4())
        threads = [threading.Thread(target=state.metrics_text) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ddp._C.DdpHook = real
    return len(made)

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


def fsdp_scrape_while_a_peer_stops(rank, world, port, stop_seconds):
    """Rank 1 stops for `stop_seconds` between forward and backward of step 1; rank 0 is then inside
    the reduce-scatter, waiting for it, while a scrape of its metrics must answer at once."""
    import threading
    import time
    import urllib.request

    import torch.distributed as dist
    from workers_fsdp import batch, loss_of, make_model, shard

    model = shard(make_model())
    hook = gt.fsdp(model, gradcomp.Q4())
    if rank == 0:
        gt.metrics.serve(port, hook, per_rank_port=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = {}
    entered = threading.Event()

    def scrape():
        entered.wait()
        time.sleep(1.0)  # rank 0 is in the reduce-scatter by now, rank 1 still stopped
        begin = time.monotonic()
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=stop_seconds).read().decode()
            result["ok"] = "gradcomp_steps_total" in text
        except OSError as e:
            result["ok"] = f"scrape failed: {e}"
        result["seconds"] = time.monotonic() - begin

    scraper = threading.Thread(target=scrape)
    if rank == 0:
        scraper.start()
    for step in range(2):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = loss_of(model, x, y)
        if step == 1:
            if rank == 1:
                time.sleep(stop_seconds)
            else:
                entered.set()
        loss.backward()
        opt.step()
    if rank == 0:
        scraper.join()
    dist.barrier()
    return result


def ddp_in_node_diloco_across_nodes(rank, world, local):
    """The recipe of docs/api.md: DDP over each node's `local` ranks, DiLoCo over the group of this
    local rank across the nodes, local_world_size left to its default under torchrun's variables.
    Returns the DiLoCo's node groups' sizes and its parameters after a round."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local))
    nodes = world // local
    node, _ = dist.new_subgroups_by_enumeration([list(range(n * local, (n + 1) * local)) for n in range(nodes)])
    across, _ = dist.new_subgroups_by_enumeration([list(range(l, world, local)) for l in range(local)])
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 4), process_group=node)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    d = gt.diloco(ddp.module, opt, gradcomp.Q4(seed=3), inner_steps=1, process_group=across)
    g = torch.Generator().manual_seed(rank // local)  # a node's ranks see the same data
    opt.zero_grad()
    ddp(torch.randn(4, 8, generator=g)).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return d.stats()["rounds"], all(torch.equal(e, flat) for e in everyone)

"""Per-rank bodies of the tests through DDP: routes, options, rebuilt buckets, AMP, profiler."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt

from workers_common import MLP, UsedInReverse, codec, flat, hook_on_route, train, train_ddp


def no_compression_matches_ddp(rank, world):
    plain, _, _ = train(rank, world, "none", None, 20)
    hooked, _, hook = train(rank, world, "register", "none", 20)
    standard, _, _ = train(rank, world, "standard", "none", 20)
    a, b, c = flat(plain), flat(hooked), flat(standard)
    assert torch.equal(a, b), f"register(NoCompression) differs from DDP: max {(a - b).abs().max().item()}"
    assert torch.equal(a, c), f"standard route differs from DDP: max {(a - c).abs().max().item()}"
    return hook.stats()["total"]["buckets"]


def routes_agree(rank, world, codec_name, dtype_name):
    dtype = getattr(torch, dtype_name)
    a, _, ha = train(rank, world, "register", codec_name, 6, dtype)
    b, _, hb = train(rank, world, "standard", codec_name, 6, dtype)
    fa, fb = flat(a), flat(b)
    assert torch.isfinite(fa).all()
    assert torch.equal(fa, fb), f"routes differ: max {(fa - fb).abs().max().item()}"
    sa, sb = ha.stats()["total"], hb.stats()["total"]
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0
    return sa


def rebuilt_buckets_release_the_old_ones(rank, world, route):
    """After DDP rebuilds its buckets, the hook keeps (and checkpoints) only the buckets in use."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(UsedInReverse(), bucket_cap_mb=0.004)
    hook = hook_on_route(ddp, route, gradcomp.Q4())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    keys = []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
        keys.append(set(hook.state_dict()["residuals"].keys()))
    buckets = hook.stats()["step"]["buckets"]
    assert buckets > 1, f"the test wants several DDP buckets, got {buckets}"
    assert keys[0] != keys[-1], "DDP kept its first-iteration buckets; the test needs a rebuild"
    assert len(keys[-1]) == buckets, f"{len(keys[-1])} residual buckets kept for {buckets} in use"
    assert keys[-1] == keys[1], "bucket identities changed after the rebuild"
    return True


def checkpoint_resume_rebuilt_layout(rank, world, codec_name):
    """Resume through DDP when its first-iteration buckets differ from the rebuilt ones the
    checkpoint saved: bit-identical to the uninterrupted run from the first step on."""
    def train(steps, start=0, state=None):
        return train_ddp(rank, UsedInReverse, {"bucket_cap_mb": 0.004}, codec_name, steps,
                          start, state, batch=16)

    uninterrupted, _, _ = train(6)
    ddp, opt, hook = train(3)
    saved = hook.state_dict()
    assert len(saved["layouts"]) == len(saved["residuals"]) > 1, saved["layouts"]
    state = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()},
             "opt": opt.state_dict(), "hook": saved}
    restarted, _, hook2 = train(3, 3, state)
    a, b = flat(uninterrupted), flat(restarted)
    assert torch.equal(a, b), f"restarted DDP run differs: max {(a - b).abs().max().item()}"
    assert set(hook2.state_dict()["residuals"].keys()) == set(saved["residuals"].keys())
    return True


def no_sync_accumulates(rank, world):
    ddp, _, hook = train(rank, world, "register", "q4", 6, no_sync_every=3)
    sd = hook.state_dict()
    assert sd["step"] == 1, sd["step"]  # two synchronised steps: 0 and 3
    assert torch.isfinite(flat(ddp)).all()
    return hook.stats()["total"]["buckets"]


def digits_accuracy(rank, world, codec, error_feedback, seeds):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import ddp_train

    return [ddp_train.train(codec, epochs=30, seed=s, error_feedback=error_feedback)[0] for s in seeds]


def run_python_block(rank, world, code):
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "docs"})
    return True


def ddp_options_agree(rank, world, option):
    """register() under a DDP option gives the same model as the standard route under it."""
    kwargs = {option: True}

    def run(route):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(MLP(), **kwargs)
        hook = hook_on_route(ddp, route, gradcomp.Q4(seed=3))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return flat(ddp), hook.stats()["total"]["buckets"]

    a, na = run("register")
    b, nb = run("standard")
    assert torch.isfinite(a).all() and na == nb > 0
    assert torch.equal(a, b), f"{option}: routes differ by {(a - b).abs().max().item()}"
    return True


def grad_scaler_skips_on_every_rank(rank, world):
    """A NaN gradient on one rank makes GradScaler skip the step on every rank."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    gt.register(ddp, gradcomp.Q4())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = flat(ddp).clone()
    x = torch.randn(8, 64)
    if rank == 1:
        x[0, 0] = float("nan")
    loss = ddp(x).square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(flat(ddp), before), "the step was taken despite a NaN on one rank"
    assert scaler.get_scale() < 1024.0
    return True


def profiler_sees_phases(rank, world):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    # Pieces, so that the collectives run on the reduction's own thread beside the codec's.
    gt.register(ddp, gradcomp.Q4(piece_numel=1024))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            ddp(torch.randn(8, 64)).square().mean().backward()
    names = {e.name for e in prof.events()}
    missing = {"gradcomp::hook_bucket", "gradcomp::all_to_all", "gradcomp::all_gather", "gradcomp::q4_encode",
               "gradcomp::q4_decode", "gradcomp::check_payloads"} - names
    assert not missing, f"not in the profiler trace: {missing}"
    threads = lambda name: {e.thread for e in prof.events() if e.name == name}
    assert not threads("gradcomp::all_to_all") & threads("gradcomp::q4_encode"), "collectives on the codec's thread"
    return True


def overlapped_buckets_equal_one_at_a_time(rank, world, codec_name, route):
    """Buckets that overlap (the default) train the very same weights as one bucket at a time."""
    spec = codec(codec_name)
    # Pieces of at least 4096 elements: the wide layers' buckets still go as hundreds of pieces,
    # without the 4096 per bucket that q4_pieces' 256 would make (70 s of the suite, for no more cover).
    pieces = max(spec.piece_numel, 4096) if spec.piece_numel else 0
    models, hooks, opts = [], [], []
    for piece_numel in (pieces, 0):
        torch.manual_seed(0)
        # A wide middle layer: its bucket's encode takes long enough for the next bucket to queue.
        ddp = nn.parallel.DistributedDataParallel(MLP(dims=(64, 1024, 1024, 1024, 10)), bucket_cap_mb=1)
        variant = dataclasses.replace(spec, piece_numel=piece_numel)
        hook = hook_on_route(ddp, route, variant)
        models.append(ddp)
        hooks.append(hook)
        opts.append(torch.optim.SGD(ddp.parameters(), lr=0.05))
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        for ddp, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        a, b = flat(models[0]), flat(models[1])
        assert torch.equal(a, b), f"step {step}: overlapped buckets differ, max {(a - b).abs().max().item()}"
    overlapped, sequential = (h.stats()["total"] for h in hooks)
    assert sequential["overlapped_buckets"] == 0, sequential
    # (Bytes may differ: piece_numel=0 also sends a bucket in one piece, without the pieces' headers.)
    assert overlapped["buckets"] == sequential["buckets"] > 0, (overlapped, sequential)
    assert hooks[0].stats()["step"]["buckets"] >= 3, hooks[0].stats()["step"]
    return overlapped["overlapped_buckets"]


class WithUnusedBranch(nn.Module):
    """Several buckets, and a branch that some steps leave unused (DDP's find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.body = MLP(dims=(64, 512, 512, 64, 10))
        self.branch = nn.Linear(64, 10)

    def forward(self, x, use_branch):
        y = self.body(x)
        return y + self.branch(x) if use_branch else y


def find_unused_parameters_trains_alike_on_every_rank(rank, world, route):
    """With find_unused_parameters DDP runs its own allreduce while the hook's buckets are still on
    the wire; the hook's collectives have their own process group, so the two never interleave."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(WithUnusedBranch(), bucket_cap_mb=0.5,
                                              find_unused_parameters=True)
    hook = hook_on_route(ddp, route, gradcomp.Q4(piece_numel=4096))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(8):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x, use_branch=step % 2 == 0), y).backward()
        opt.step()
    weights = flat(ddp)
    assert torch.isfinite(weights).all()
    gathered = [torch.empty_like(weights) for _ in range(world)]
    torch.distributed.all_gather(gathered, weights)
    assert all(torch.equal(gathered[0], w) for w in gathered), "ranks' weights differ"
    assert hook.stats()["step"]["buckets"] >= 2, hook.stats()["step"]
    return True


def worker_cpus_placement(rank, world, route, request):
    """Trains two steps with the hook's worker placed as `request` asks; returns the worker's
    CPUs, how they were chosen, and the CPUs of the thread that ran backward."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    hook = hook_on_route(ddp, route, gradcomp.Q4(), worker_cpus=request)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        ddp(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
    return hook.worker_cpus, hook.worker_placement, sorted(os.sched_getaffinity(0))

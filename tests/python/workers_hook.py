"""Per-rank bodies of the tests of the hook itself: reference equality, checkpoints, NaN, layouts."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import gradcomp
from gradcomp import _C

import reference
from workers_common import MLP, codec, flat, grad, reduce_steps, train_ddp

MASK = 0xFFFFFFFF


def reference_equality(rank, world, codec_name, n, device="cpu"):
    """The hook's averaged bucket (on `device`) equals the pure-PyTorch reference bit for bit,
    over 4 steps."""
    core = _C.DdpHook(dist.group.WORLD, codec(codec_name)._options())
    shapes = [[n]]
    bucket_id = _C.bucket_identity(0, torch.zeros(n), shapes) & MASK
    spec = codec(codec_name)
    if codec_name.startswith("q4"):
        ref = reference.Q4TwoPhase(world, n, seed=5, stochastic=codec_name != "q4_nearest")
    elif codec_name == "topk_q4warmup":
        ref = reference.TopKQ4Warmup(world, n, spec.ratio, spec.warmup_steps, seed=5)
    elif codec_name.startswith("topk_dgc"):
        ref = reference.TopKDgc(world, n, spec.ratio, spec.momentum, spec.momentum_masking, spec.clip_norm,
                                spec.warmup_steps, spec.warmup_stages)
    else:
        ref = reference.TopKExact(world, n, 0.01)
    for step in range(4):
        grads = [grad(r, step, n) for r in range(world)]
        if codec_name.startswith("q4") or codec_name == "topk_q4warmup":
            expect = ref.step(grads, step, bucket_id)
        else:
            expect = ref.step(grads, step) if codec_name.startswith("topk_dgc") else ref.step(grads)
        bucket = grads[rank].clone().to(device)
        core.reduce_bucket(bucket, 0, shapes)
        bucket = bucket.cpu()
        if not torch.equal(bucket.view(torch.int32), expect.view(torch.int32)):
            diff = (bucket - expect).abs()
            raise AssertionError(f"step {step}: {int((diff > 0).sum())} elements differ, max {diff.max().item()}")
    stats = core.total_stats()
    return stats["bytes_sent"], stats["uncompressed_bytes"]


def state_round_trip(rank, world, codec_name, device="cpu"):
    """The hook's own state round trip, on fixed buckets on `device`: 3 steps, save, a new hook
    loads the state, 3 more steps; equal to 6 uninterrupted steps bit for bit."""

    def run(core, steps):
        return reduce_steps(core, rank, steps, device=device)

    options = codec(codec_name)._options()
    full = run(_C.DdpHook(dist.group.WORLD, options), range(6))
    first = _C.DdpHook(dist.group.WORLD, options)
    run(first, range(3))
    saved = first.state_dict()
    second = _C.DdpHook(dist.group.WORLD, options)
    second.load_state_dict(saved)
    resumed = run(second, range(3, 6))
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a, b), f"resumed hook differs: max {(a - b).abs().max().item()}"
    return True


def checkpoint_resume(rank, world, codec_name):
    state_round_trip(rank, world, codec_name)

    # Through DDP and gt.register. DDP builds its first-iteration bucket in parameter order and
    # rebuilds it in gradient-ready order; with one parameter tensor the two agree, so the
    # restarted model sees the saved bucket layout (docs/api.md, "Checkpoints").
    def train(steps, start=0, state=None):
        return train_ddp(rank, lambda: MLP((64, 10), bias=False), {}, codec_name, steps, start,
                          state, batch=32)

    uninterrupted, _, _ = train(8)
    ddp, opt, hook = train(4)
    state = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "opt": opt.state_dict(),
             "hook": hook.state_dict()}
    assert state["hook"]["step"] == 3 and len(state["hook"]["residuals"]) == 1
    restarted, _, _ = train(4, 4, state)
    a, b = flat(uninterrupted), flat(restarted)
    assert torch.equal(a, b), f"restarted DDP run differs: max {(a - b).abs().max().item()}"
    return True


def nan_propagates(rank, world, codec_name, device="cpu"):
    n = 4096
    core = _C.DdpHook(dist.group.WORLD, codec(codec_name)._options())
    bucket = grad(rank, 0, n).to(device)
    core.reduce_bucket(bucket, 0, [[n]])
    before = core.state_dict()
    bucket = grad(rank, 1, n).to(device)
    if rank == world - 1:
        bucket[1234] = float("nan")
    core.reduce_bucket(bucket, 0, [[n]])
    assert not torch.isfinite(bucket).all(), "NaN did not reach this rank"
    after = core.state_dict()
    for key in ("residuals", "chunk_residuals"):
        assert before[key].keys() == after[key].keys()
        for k in before[key]:
            assert torch.equal(before[key][k], after[key][k]), f"{key} changed on a non-finite step"
    assert core.last_step_stats()["nonfinite_buckets"] == 1
    return True


def layout_mismatch(rank, world):
    n = 1000 if rank != 1 else 1064
    core = _C.DdpHook(dist.group.WORLD, gradcomp.Q4()._options())
    start = time.monotonic()
    try:
        core.reduce_bucket(torch.randn(n), 0, [[1000]])
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        assert "layout mismatch" in str(e) and "rank 1" in str(e), str(e)
        assert elapsed < 10, elapsed
        return elapsed
    raise AssertionError("no error for mismatched layouts")

"""Per-rank bodies of the fault tests: dead peers, bad bytes, foreign checkpoints, slow ranks,
long runs and several hooks in one process."""
from __future__ import annotations

import gc
import os
import resource
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

from workers_common import MLP, codec, flat, grad


def threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def thread_names() -> list:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _batch(step: int, rank: int, n: int = 32):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def survive_a_dead_peer(rank, world, victim, phase, pause_file, deadline=None):
    """Trains until a collective fails; the victim stops at `phase` (the test kills it there).
    Returns the survivor's error, how long it took to appear, and its hook's worker threads while
    it trained and after the hook was dropped."""
    torch.manual_seed(0)
    model = MLP()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    fault = None
    if rank == victim and phase != "backward":
        collective, after = {"encode": ("all_to_all", False), "all_to_all": ("all_to_all", True),
                             "all_gather": ("all_gather", True)}[phase]
        # The first step's first bucket (its layout check is an all-gather, before the all-to-all).
        fault = {"action": "pause", "collective": collective, "call": 0, "rank": victim, "after": after,
                 "pause_file": pause_file}
    hook = gt.register(ddp, gradcomp.Q4(), timeout=deadline, _fault=fault)
    held = [hook]  # what the victim's backward hook looks at; cleared with the hook below
    if rank == victim and phase == "backward":
        def stop(module, grad_in, grad_out):
            if held[0].stats()["total"]["buckets"] > 0:
                open(pause_file, "w").close()
                time.sleep(3600)
        model.net[2].register_full_backward_hook(stop)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    started, error, workers_alive = None, None, 0
    try:
        for step in range(50):
            x, y = _batch(step, rank)
            opt.zero_grad()
            started = time.monotonic()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    except RuntimeError as e:
        error, elapsed = str(e), time.monotonic() - started
        workers_alive = thread_names().count("gradcomp-worker")
    if error is None:
        raise AssertionError("no error although a peer died")
    # The hook, its DDP model and whatever held them go; a worker thread that outlived its hook
    # would still count below.
    held.clear()
    del hook, ddp, opt, model
    gc.collect()
    return {"error": error, "elapsed": elapsed, "workers_while_training": workers_alive,
            "workers_after": thread_names().count("gradcomp-worker")}


def diloco_survives_a_dead_peer(rank, world, victim, pause_file):
    """DiLoCo with overlap_steps = 2: the victim stops right after a sync point, its round in flight on
    the background thread (the test kills it there). Every survivor must raise, naming what failed,
    instead of waiting on a round that cannot finish."""
    import workers_diloco

    model = workers_diloco.make_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = 4
    d = gt.diloco(model, opt, gradcomp.Q4(), inner_steps=h, overlap_steps=2, outer_lr=1.0, outer_momentum=0.3)
    started, error, elapsed = None, None, None
    try:
        for t in range(1, 12 * h + 1):
            started = time.monotonic()
            workers_diloco.inner_step(model, opt, rank, t, "cpu")
            if rank == victim and t == 2 * h:  # this step launched round 2 in the background
                open(pause_file, "w").close()
                time.sleep(3600)
    except Exception as e:  # noqa: BLE001 - the report carries whatever the survivor saw
        error, elapsed = f"{type(e).__name__}: {e}", time.monotonic() - started
    if error is None:
        raise AssertionError("no error although a peer died")
    return {"error": error, "elapsed": elapsed, "rounds": d.stats()["rounds"]}


def _run_steps(native, rank, steps, n=3001, retry=False):
    out = []
    for step in steps:
        bucket = grad(rank, step, n)
        before = bucket.clone()
        try:
            native.reduce_bucket(bucket, 0, [[n]])
        except RuntimeError as e:
            if not retry:
                raise
            assert torch.equal(bucket, before), "the refused bucket was written"
            bucket = before.clone()
            native.reduce_bucket(bucket, 0, [[n]])
            out.append(("retried", str(e)))
        out.append(bucket)
    return out


def bad_bytes_are_refused_by_every_rank(rank, world, codec_name, action):
    """A peer's damaged payload: every rank raises naming it, and redoing the step is exact."""
    options = codec(codec_name)._options()
    clean = _run_steps(_C.DdpHook(dist.group.WORLD, options), rank, range(4))
    # The all-gather of step 2 (after the layout check's and those of steps 0 and 1).
    options = {**options, "fault": {"action": action, "collective": "all_gather", "call": 3, "rank": 1}}
    faulty = _run_steps(_C.DdpHook(dist.group.WORLD, options), rank, range(4), retry=True)
    notes = [x for x in faulty if isinstance(x, tuple)]
    results = [x for x in faulty if not isinstance(x, tuple)]
    assert len(notes) == 1, notes
    message = notes[0][1]
    assert "from rank 1" in message and "bucket 0" in message and "step 2" in message, message
    for step, (a, b) in enumerate(zip(clean, results)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"step {step} differs after the retry"
    return True


def foreign_checkpoints_are_refused_whole(rank, world, codec_name):
    options = codec(codec_name)._options()
    source = _C.DdpHook(dist.group.WORLD, options)
    _run_steps(source, rank, range(2))
    good = source.state_dict()
    target = _C.DdpHook(dist.group.WORLD, options)
    _run_steps(target, rank, range(1))
    hook = gt.Hook(target, codec(codec_name))
    before = target.state_dict()

    def tensor_key(sd):
        return next(iter(sd["residuals"]))

    bad = []
    for name, mutate in [
        ("format", lambda sd: sd.update(format=2)),
        ("seed type", lambda sd: sd.update(seed="5")),
        ("missing step", lambda sd: sd.pop("step")),
        ("world size", lambda sd: sd.update(world_size=world + 1)),
        ("residual dtype", lambda sd: sd["residuals"].update({tensor_key(sd): sd["residuals"][tensor_key(sd)].float()})),
        ("residual shape", lambda sd: sd["residuals"].update({tensor_key(sd): sd["residuals"][tensor_key(sd)].view(1, -1)})),
        ("truncated residual", lambda sd: sd["residuals"].update({tensor_key(sd): sd["residuals"][tensor_key(sd)][:-4]})),
        ("bucket key", lambda sd: sd["residuals"].update({"x": torch.zeros(4, dtype=torch.uint8)})),
        ("layout", lambda sd: sd.update(layouts={1: {"index": 0, "dtype": 7, "params": []}})),
    ]:
        sd = {k: (dict(v) if isinstance(v, dict) else v) for k, v in good.items()}
        mutate(sd)
        try:
            hook.load_state_dict(sd)
        except (ValueError, RuntimeError) as e:
            bad.append((name, str(e)))
        else:
            raise AssertionError(f"{name}: malformed state accepted")
        after = target.state_dict()
        assert after["step"] == before["step"] and after["residuals"].keys() == before["residuals"].keys() and all(
            torch.equal(after["residuals"][k], before["residuals"][k]) for k in before["residuals"]), \
            f"{name}: refused state was partly loaded"
    return bad


def a_slow_rank_sets_the_pace(rank, world):
    torch.manual_seed(0)
    model = MLP()
    if rank == 1:
        model.net[0].register_full_backward_hook(lambda *args: time.sleep(0.3))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    hook = gt.register(ddp, gradcomp.Q4())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    for step in range(6):
        x, y = _batch(step, rank)
        t0 = time.monotonic()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.monotonic() - t0)
    stats = hook.stats()
    return {"times": times[1:], "max_queued": stats["total"]["max_queued"], "buckets": stats["step"]["buckets"]}


def soak(rank, world, codec_name, steps):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP(), bucket_cap_mb=0.01)
    gt.register(ddp, codec(codec_name))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    samples = {}
    for step in range(steps):
        x, y = _batch(step % 50, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if step in (steps // 10, steps - 1):
            samples[step] = (rss_mb(), threads(), open_files())
    return samples


def hooks_come_and_go(rank, world, count):
    samples = []
    for i in range(count):
        torch.manual_seed(i)
        ddp = nn.parallel.DistributedDataParallel(MLP())
        hook = gt.register(ddp, gradcomp.Q4() if i % 2 else gradcomp.TopK())
        x, y = _batch(i, rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        del hook, ddp
        if i in (count // 10, count - 1):
            samples.append((rss_mb(), threads(), open_files()))
    return samples


def two_models_and_user_collectives(rank, world):
    """Two DDP models with two hooks, and the user's own allreduce between steps, give the models
    each one alone would."""
    def train(models, with_user_collective):
        ddps = []
        for seed, m in models:
            torch.manual_seed(seed)
            ddp = nn.parallel.DistributedDataParallel(MLP())
            gt.register(ddp, codec(m))
            ddps.append((ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)))
        for step in range(5):
            for k, (ddp, opt) in enumerate(ddps):
                x, y = _batch(step * 7 + k, rank)
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            if with_user_collective:
                t = torch.full((3,), float(rank))
                dist.all_reduce(t)
                assert t[0].item() == sum(range(world))
        return [flat(ddp) for ddp, _ in ddps]

    together = train([(1, "q4"), (2, "topk")], True)
    alone_a = train([(1, "q4")], False)[0]
    # The second model alone sees the batches it saw as the second of two.
    torch.manual_seed(2)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    gt.register(ddp, codec("topk"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(5):
        x, y = _batch(step * 7 + 1, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    alone_b = flat(ddp)
    assert torch.equal(together[0], alone_a) and torch.equal(together[1], alone_b)
    return True


def checkpoint_for_another_world(rank, world, path):
    hook = _C.DdpHook(dist.group.WORLD, gradcomp.Q4()._options())
    _run_steps(hook, rank, range(2))
    if rank == 0:
        torch.save(hook.state_dict(), path)
    return True


def load_checkpoint_of_another_world(rank, world, path):
    hook = gt.Hook(_C.DdpHook(dist.group.WORLD, gradcomp.Q4()._options()), gradcomp.Q4())
    try:
        hook.load_state_dict(torch.load(path, weights_only=True))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a checkpoint of another world size was accepted")


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)

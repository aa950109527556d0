"""Per-rank bodies of the multi-process tests (run under a Gloo process group by launcher.py)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

import reference

MASK = 0xFFFFFFFF


def _codec(name: str):
    return {"q4": gradcomp.Q4(seed=5), "q4_nearest": gradcomp.Q4(rounding="nearest", seed=5),
            "topk": gradcomp.TopK(ratio=0.01), "none": gradcomp.NoCompression(),
            "topk_no_ef": gradcomp.TopK(ratio=0.01, error_feedback=False)}[name]


def _grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * (1.0 + rank)


def reference_equality(rank, world, codec_name, n):
    """The hook's averaged bucket equals the pure-PyTorch reference bit for bit, over 3 steps."""
    codec = _codec(codec_name)
    core = _C.HookCore(dist.group.WORLD, codec._options())
    shapes = [[n]]
    bucket_id = _C.bucket_identity(0, torch.zeros(n), shapes) & MASK
    ref = (reference.Q4TwoPhase(world, n, seed=5, stochastic=codec_name == "q4") if codec_name.startswith("q4")
           else reference.TopKExact(world, n, 0.01))
    for step in range(3):
        grads = [_grad(r, step, n) for r in range(world)]
        expect = ref.step(grads, step, bucket_id) if codec_name.startswith("q4") else ref.step(grads)
        bucket = grads[rank].clone()
        core.reduce_bucket(bucket, 0, shapes)
        if not torch.equal(bucket.view(torch.int32), expect.view(torch.int32)):
            diff = (bucket - expect).abs()
            raise AssertionError(f"step {step}: {int((diff > 0).sum())} elements differ, max {diff.max().item()}")
    stats = core.total_stats()
    return stats["bytes_sent"], stats["uncompressed_bytes"]


class MLP(nn.Module):
    def __init__(self, dims=(64, 128, 64, 10), bias=True):
        super().__init__()
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


def _train(rank, world, route: str, codec_name: str | None, steps: int, dtype=torch.float32,
           state=None, start_step: int = 0, no_sync_every: int = 0, bias: bool = True):
    """Trains a small MLP on per-rank random data; returns (model, optimizer, hook)."""
    torch.manual_seed(0)
    model = MLP(bias=bias).to(dtype)
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = None
    if route == "register":
        hook = gt.register(ddp, _codec(codec_name))
    elif route == "standard":
        hook = gt.HookState(_codec(codec_name))
        ddp.register_comm_hook(hook, gt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if hook is not None:
            hook.load_state_dict(state["hook"])
    for step in range(start_step, start_step + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 64, generator=g).to(dtype)
        y = torch.randint(0, 10, (32,), generator=g)
        if no_sync_every and step % no_sync_every != 0:
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x).float(), y).backward()
            continue
        opt.zero_grad(set_to_none=False) if not no_sync_every else None
        nn.functional.cross_entropy(ddp(x).float(), y).backward()
        opt.step()
        if no_sync_every:
            opt.zero_grad()
    return ddp, opt, hook


def _flat(ddp) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()])


def no_compression_matches_ddp(rank, world):
    plain, _, _ = _train(rank, world, "none", None, 20)
    hooked, _, hook = _train(rank, world, "register", "none", 20)
    standard, _, _ = _train(rank, world, "standard", "none", 20)
    a, b, c = _flat(plain), _flat(hooked), _flat(standard)
    assert torch.equal(a, b), f"register(NoCompression) differs from DDP: max {(a - b).abs().max().item()}"
    assert torch.equal(a, c), f"standard route differs from DDP: max {(a - c).abs().max().item()}"
    return hook.stats()["total"]["buckets"]


def routes_agree(rank, world, codec_name, dtype_name):
    dtype = getattr(torch, dtype_name)
    a, _, ha = _train(rank, world, "register", codec_name, 6, dtype)
    b, _, hb = _train(rank, world, "standard", codec_name, 6, dtype)
    fa, fb = _flat(a), _flat(b)
    assert torch.isfinite(fa).all()
    assert torch.equal(fa, fb), f"routes differ: max {(fa - fb).abs().max().item()}"
    sa, sb = ha.stats()["total"], hb.stats()["total"]
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0
    return sa


class _UsedInReverse(nn.Module):
    """Layers registered in the opposite order to their use, so DDP's rebuilt buckets (gradient
    ready order) differ from its first-iteration buckets (parameter order)."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(32, 10)
        self.middle = nn.Linear(32, 32)
        self.first = nn.Linear(64, 32)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def rebuilt_buckets_release_the_old_ones(rank, world, route):
    """After DDP rebuilds its buckets, the hook keeps (and checkpoints) only the buckets in use."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_UsedInReverse(), bucket_cap_mb=0.004)
    if route == "register":
        hook = gt.register(ddp, gradcomp.Q4())
    else:
        hook = gt.HookState(gradcomp.Q4())
        ddp.register_comm_hook(hook, gt.comm_hook)
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


def _train_ddp(rank, make_model, ddp_kwargs, codec_name, steps, start, state, batch):
    """Builds DDP + hook + SGD with momentum (restored from `state` when given) and trains
    `steps` steps from `start` on per-rank random 64-feature batches; returns (ddp, opt, hook)."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make_model(), **ddp_kwargs)
    hook = gt.register(ddp, _codec(codec_name))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        hook.load_state_dict(state["hook"])
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return ddp, opt, hook


def checkpoint_resume(rank, world, codec_name):
    # The hook's own state round trip, on fixed buckets: 3 steps, save, a new hook loads the
    # state, 3 more steps; equal to 6 uninterrupted steps bit for bit.
    shapes = [[3001]]

    def run(core, steps):
        out = []
        for step in steps:
            bucket = _grad(rank, step, 3001)
            core.reduce_bucket(bucket, 0, shapes)
            out.append(bucket)
        return out

    options = _codec(codec_name)._options()
    full = run(_C.HookCore(dist.group.WORLD, options), range(6))
    first = _C.HookCore(dist.group.WORLD, options)
    run(first, range(3))
    saved = first.state_dict()
    second = _C.HookCore(dist.group.WORLD, options)
    second.load_state_dict(saved)
    resumed = run(second, range(3, 6))
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a, b), f"resumed hook differs: max {(a - b).abs().max().item()}"

    # Through DDP and gt.register. DDP builds its first-iteration bucket in parameter order and
    # rebuilds it in gradient-ready order; with one parameter tensor the two agree, so the
    # restarted model sees the saved bucket layout (docs/api.md, "Checkpoints").
    def train(steps, start=0, state=None):
        return _train_ddp(rank, lambda: MLP((64, 10), bias=False), {}, codec_name, steps, start,
                          state, batch=32)

    uninterrupted, _, _ = train(8)
    ddp, opt, hook = train(4)
    state = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()}, "opt": opt.state_dict(),
             "hook": hook.state_dict()}
    assert state["hook"]["step"] == 3 and len(state["hook"]["residuals"]) == 1
    restarted, _, _ = train(4, 4, state)
    a, b = _flat(uninterrupted), _flat(restarted)
    assert torch.equal(a, b), f"restarted DDP run differs: max {(a - b).abs().max().item()}"
    return True


def checkpoint_resume_rebuilt_layout(rank, world, codec_name):
    """Resume through DDP when its first-iteration buckets differ from the rebuilt ones the
    checkpoint saved: bit-identical to the uninterrupted run from the first step on."""
    def train(steps, start=0, state=None):
        return _train_ddp(rank, _UsedInReverse, {"bucket_cap_mb": 0.004}, codec_name, steps,
                          start, state, batch=16)

    uninterrupted, _, _ = train(6)
    ddp, opt, hook = train(3)
    saved = hook.state_dict()
    assert len(saved["layouts"]) == len(saved["residuals"]) > 1, saved["layouts"]
    state = {"model": {k: v.clone() for k, v in ddp.module.state_dict().items()},
             "opt": opt.state_dict(), "hook": saved}
    restarted, _, hook2 = train(3, 3, state)
    a, b = _flat(uninterrupted), _flat(restarted)
    assert torch.equal(a, b), f"restarted DDP run differs: max {(a - b).abs().max().item()}"
    assert set(hook2.state_dict()["residuals"].keys()) == set(saved["residuals"].keys())
    return True


def nan_propagates(rank, world, codec_name):
    n = 4096
    core = _C.HookCore(dist.group.WORLD, _codec(codec_name)._options())
    bucket = _grad(rank, 0, n)
    core.reduce_bucket(bucket, 0, [[n]])
    before = core.state_dict()
    bucket = _grad(rank, 1, n)
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
    core = _C.HookCore(dist.group.WORLD, gradcomp.Q4()._options())
    start = time.monotonic()
    try:
        core.reduce_bucket(torch.randn(n), 0, [[1000]])
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        assert "layout mismatch" in str(e) and "rank 1" in str(e), str(e)
        assert elapsed < 10, elapsed
        return elapsed
    raise AssertionError("no error for mismatched layouts")


def no_sync_accumulates(rank, world):
    ddp, _, hook = _train(rank, world, "register", "q4", 6, no_sync_every=3)
    sd = hook.state_dict()
    assert sd["step"] == 1, sd["step"]  # two synchronised steps: 0 and 3
    assert torch.isfinite(_flat(ddp)).all()
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
        if route == "register":
            hook = gt.register(ddp, gradcomp.Q4(seed=3))
        else:
            hook = gt.HookState(gradcomp.Q4(seed=3))
            ddp.register_comm_hook(hook, gt.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return _flat(ddp), hook.stats()["total"]["buckets"]

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
    before = _flat(ddp).clone()
    x = torch.randn(8, 64)
    if rank == 1:
        x[0, 0] = float("nan")
    loss = ddp(x).square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(_flat(ddp), before), "the step was taken despite a NaN on one rank"
    assert scaler.get_scale() < 1024.0
    return True


def profiler_sees_phases(rank, world):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    gt.register(ddp, gradcomp.Q4())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            ddp(torch.randn(8, 64)).square().mean().backward()
    names = {e.name for e in prof.events()}
    missing = {"gradcomp::hook_bucket", "gradcomp::all_to_all", "gradcomp::all_gather"} - names
    assert not missing, f"not in the profiler trace: {missing}"
    return True


def gpu_hook_matches_cpu(rank, world, codec_name):
    """On one GPU (NCCL, world 1) the hook's averaged buckets equal the CPU hook's bit for bit."""
    results = {}
    for device in ("cpu", "cuda"):
        group = dist.new_group(backend="gloo" if device == "cpu" else "nccl")
        core = _C.HookCore(group, _codec(codec_name)._options())
        out = []
        for step in range(3):
            bucket = _grad(rank, step, 10007).to(device)
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
    assert torch.isfinite(_flat(ddp)).all() and hook.stats()["total"]["buckets"] >= 5
    import json
    import tempfile
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

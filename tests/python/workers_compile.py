"""Per-rank bodies of the torch.compile tests: the hook under DDPOptimizer, the refused modes."""
from __future__ import annotations

import warnings

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

from workers_common import MLP, codec, flat, hook_on_route


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _hooked(route, codec_name, compiled, backend):
    torch.manual_seed(0)
    # Several buckets, so DDPOptimizer splits the compiled graph at their borders (it needs the
    # first bucket, 1 MB, to be no larger than the others).
    ddp = nn.parallel.DistributedDataParallel(MLP(dims=(64, 512, 512, 512, 10)), bucket_cap_mb=1)
    model = torch.compile(ddp, backend=backend) if compiled else ddp
    # register() takes the compiled wrapper; the standard route registers on the DDP module.
    hook = hook_on_route(model if route == "register" else ddp, route, codec(codec_name))
    return ddp, model, hook


def compiled_ddp_runs_the_hook(rank, world, route, codec_name, backend):
    """torch.compile of a DDP model (default optimize_ddp) runs the hook on every bucket of every
    step and trains as the eager model does."""
    torch._dynamo.reset()
    assert torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"
    runs = [_hooked(route, codec_name, compiled, backend) for compiled in (False, True)]
    opts = [torch.optim.SGD(ddp.parameters(), lr=0.05) for ddp, _, _ in runs]
    buckets = None
    for step in range(4):
        x, y = _batch(step, rank)
        for (ddp, model, hook), opt in zip(runs, opts):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        eager, compiled = (h.stats()["step"] for _, _, h in runs)
        assert compiled["buckets"] == eager["buckets"] > 0, (step, eager, compiled)
        assert compiled["bytes_sent"] == eager["bytes_sent"] > 0, (step, eager, compiled)
        buckets = compiled["buckets"]
        # Every rank's data differs: equal parameters on every rank mean the buckets were averaged.
        b = flat(runs[1][0])
        gathered = [torch.empty_like(b) for _ in range(world)]
        dist.all_gather(gathered, b)
        assert all(torch.equal(g, b) for g in gathered), f"step {step}: ranks hold different parameters"
    assert buckets >= 2, "DDP rebuilt its buckets after the first step: several from then on"
    # The compiled graphs round differently from eager, and q4's stochastic rounding turns that
    # into quantization-sized differences: close, not equal.
    a = flat(runs[0][0])
    assert (a - b).abs().max() < 1e-2, f"compiled differs from eager: {(a - b).abs().max()}"
    return buckets


def python_reducer_is_refused(rank, world):
    """optimize_ddp="python_reducer" replaces the C++ reducer: register and HookState refuse it,
    and a hook registered by the standard route before the mode was set raises at backward."""
    torch._dynamo.reset()
    messages = []
    early_state = gt.HookState(gradcomp.Q4())  # made before the mode changes
    try:
        torch._dynamo.config.optimize_ddp = "python_reducer"
        ddp = nn.parallel.DistributedDataParallel(MLP())
        for make in (lambda: gt.register(ddp, gradcomp.Q4()), lambda: gt.register(torch.compile(ddp)),
                     lambda: gt.HookState(gradcomp.Q4())):
            try:
                make()
            except RuntimeError as e:
                messages.append(str(e))
            else:
                raise AssertionError("a python_reducer DDP model was accepted")
        ddp.register_comm_hook(early_state, gt.comm_hook)
        x, y = _batch(0, rank)
        try:
            nn.functional.cross_entropy(ddp(x), y).backward()
        except RuntimeError as e:
            messages.append(str(e))
        else:
            raise AssertionError("the standard route ran per parameter under python_reducer")
    finally:
        torch._dynamo.config.optimize_ddp = True
    assert all("python_reducer" in m and "ddp_optimizer" in m for m in messages), messages
    return len(messages)


def _backward_under_compiled_autograd(model, x, y) -> str:
    """The error of one backward under compiled autograd (which must raise)."""
    from torch._dynamo import compiled_autograd

    with compiled_autograd._enable(torch.compile(backend="eager")):
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except RuntimeError as e:
            return str(e)
    raise AssertionError("a backward under compiled autograd went through")


def compiled_autograd_is_refused(rank, world, route):
    """Compiled autograd replaces the C++ reducer: register refuses it when it is on, warns when
    only its config flag is set, and a backward under it raises without reducing a bucket (the
    standard route sees its model from the first bucket on, so after one eager step)."""
    torch._dynamo.reset()
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    with compiled_autograd._enable(torch.compile(backend="eager")):
        try:
            hook_on_route(ddp, route, gradcomp.Q4())
        except RuntimeError as e:
            refused = str(e)
        else:
            raise AssertionError("compiled autograd was accepted")
    assert "compiled autograd" in refused, refused
    torch._dynamo.config.compiled_autograd = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook = hook_on_route(ddp, route, gradcomp.Q4())
    finally:
        torch._dynamo.config.compiled_autograd = False
    assert any("compiled_autograd" in str(w.message) for w in caught), [str(w.message) for w in caught]
    x, y = _batch(0, rank)
    eager_buckets = 0
    if route == "standard":
        nn.functional.cross_entropy(ddp(x), y).backward()
        eager_buckets = hook.stats()["total"]["buckets"]
    raised = _backward_under_compiled_autograd(ddp, x, y)
    # torch 2.15's reducer raises; on older ones gradcomp's guard does (they skip the reducer).
    assert "compiled autograd" in raised.lower(), raised
    assert hook.stats()["total"]["buckets"] == eager_buckets, hook.stats()
    return True


def grad_sync_under_compiled_autograd(rank, world):
    """GradSync averages gradients from Python as from C++, and refuses compiled autograd by name
    (its accumulate-grad hooks have no graph form: older torch would drop them silently)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    sync = _C.GradSync(list(model.parameters()), dist.group.WORLD, gradcomp.NoCompression()._options())
    x, y = _batch(0, rank)
    nn.functional.cross_entropy(model(x), y).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    sync.finish()
    averaged = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    expected = mine.clone()
    dist.all_reduce(expected)
    assert torch.allclose(averaged, expected / world, rtol=1e-6, atol=1e-7)
    model.zero_grad()
    refused = _backward_under_compiled_autograd(model, x, y)
    assert "GradSync does not run under compiled autograd" in refused, refused
    return True

"""Helpers shared by the per-rank test bodies: codecs by name, gradients, a small MLP, DDP runs."""
from __future__ import annotations

import torch
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt

def codec(name: str):
    return {"q4": gradcomp.Q4(seed=5), "q4_nearest": gradcomp.Q4(rounding="nearest", seed=5),
            # Pieces of 256 elements: a 3001-element bucket overlaps a dozen of them per rank.
            "q4_pieces": gradcomp.Q4(seed=5, piece_numel=256),
            "topk": gradcomp.TopK(ratio=0.01), "none": gradcomp.NoCompression(),
            "topk_no_ef": gradcomp.TopK(ratio=0.01, error_feedback=False),
            # DGC's remedies: momentum correction, clipping that acts on these gradients, warm-up.
            "topk_dgc": gradcomp.TopK(ratio=0.01, momentum=0.9, clip_norm=30.0, warmup_steps=2),
            "topk_dgc_nomask": gradcomp.TopK(ratio=0.01, momentum=0.9, momentum_masking=False),
            # Adam's setting: q4 for the first 3 steps, then top-k.
            "topk_q4warmup": gradcomp.TopK(ratio=0.01, warmup="q4", warmup_steps=3, seed=5)}[name]


def grad(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * (1.0 + rank)


def reduce_steps(core, rank: int, steps, n: int = 3001, device="cpu") -> list:
    """Hands one bucket of `n` elements per step to a native hook; returns the averaged buckets
    (on the CPU)."""
    out = []
    for step in steps:
        bucket = grad(rank, step, n).to(device)
        core.reduce_bucket(bucket, 0, [[n]])
        out.append(bucket.cpu())
    return out


class MLP(nn.Module):
    def __init__(self, dims=(64, 128, 64, 10), bias=True):
        super().__init__()
        layers = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Linear(a, b, bias=bias), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.net(x)


def hook_on_route(ddp, route: str, spec, **kwargs):
    """Installs gradcomp on `ddp` by register() ("register") or PyTorch's standard route
    ("standard"); returns the hook."""
    if route == "register":
        return gt.register(ddp, spec, **kwargs)
    if route != "standard":
        raise ValueError(f"unknown route {route!r}")
    hook = gt.HookState(spec, **kwargs)
    ddp.register_comm_hook(hook, gt.comm_hook)
    return hook


def train(rank, world, route: str, codec_name: str | None, steps: int, dtype=torch.float32,
           state=None, start_step: int = 0, no_sync_every: int = 0, bias: bool = True,
           local_world_size=None):
    """Trains a small MLP on per-rank random data; returns (model, optimizer, hook)."""
    torch.manual_seed(0)
    model = MLP(bias=bias).to(dtype)
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = None
    if route in ("register", "standard"):
        hook = hook_on_route(ddp, route, codec(codec_name), local_world_size=local_world_size)
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


def flat(ddp) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()])


class UsedInReverse(nn.Module):
    """Layers registered in the opposite order to their use, so DDP's rebuilt buckets (gradient
    ready order) differ from its first-iteration buckets (parameter order)."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(32, 10)
        self.middle = nn.Linear(32, 32)
        self.first = nn.Linear(64, 32)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def train_ddp(rank, make_model, ddp_kwargs, codec_name, steps, start, state, batch):
    """Builds DDP + hook + SGD with momentum (restored from `state` when given) and trains
    `steps` steps from `start` on per-rank random 64-feature batches; returns (ddp, opt, hook)."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(make_model(), **ddp_kwargs)
    hook = gt.register(ddp, codec(codec_name))
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

"""Per-rank body for the C++ trainer tests: the Python DDP hook's core fed the trainer's buckets."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import gradcomp
import gradcomp.torch as gt
from gradcomp import _C

import reference

MASK = 0xFFFFFFFF


def load_dump(path: str, total: int, steps: int):
    """(local, averaged) float32 gradients of each step, as the trainer's --dump writes them."""
    data = np.fromfile(path, dtype="<f4")
    assert data.size == 2 * steps * total, (data.size, steps, total)
    data = torch.from_numpy(data.copy()).view(steps, 2, total)
    return data[:, 0], data[:, 1]


def bucket_slices(layout: dict):
    """For each bucket, the (start, end) of each of its parameters in the flat dump, in order."""
    sizes = [int(np.prod(s)) for s in layout["shapes"]]
    starts = np.cumsum([0] + sizes)
    return [[(int(starts[p]), int(starts[p] + sizes[p])) for p in bucket] for bucket in layout["buckets"]]


def trainer_codec(name: str):
    """The Python spec of the codec examples/cpp/trainer.cpp runs under --codec `name`."""
    return {"q4": gradcomp.Q4(), "topk": gradcomp.TopK(ratio=0.01),
            "topk-dgc": gradcomp.TopK(ratio=0.01, momentum=0.9, clip_norm=5.0, warmup_steps=2),
            "topk-q4warmup": gradcomp.TopK(ratio=0.01, warmup="q4", warmup_steps=2)}[name]


def python_hook_matches(rank, world, dump, layout, steps, codec_name, local=1):
    """The DDP hook's core, given each bucket the trainer reduced, averages it to the same bits
    (with `local` ranks per node: both hierarchical)."""
    codec = trainer_codec(codec_name)
    hook = _C.DdpHook(dist.group.WORLD, codec._options(), *gt.node_groups(None, local))
    total = sum(int(np.prod(s)) for s in layout["shapes"])
    local, averaged = load_dump(f"{dump}.rank{rank}", total, steps)
    for step in range(steps):
        for index, (bucket, slices) in enumerate(zip(layout["buckets"], bucket_slices(layout))):
            flat = torch.cat([local[step, a:b] for a, b in slices])
            expect = torch.cat([averaged[step, a:b] for a, b in slices])
            shapes = [layout["shapes"][p] for p in bucket]
            hook.reduce_bucket(flat, index, shapes, index + 1 == len(layout["buckets"]))
            assert torch.equal(flat.view(torch.int32), expect.view(torch.int32)), \
                f"step {step} bucket {index}: {int((flat != expect).sum())} elements differ"
    return True


def check_against_reference(dump: str, layout: dict, world: int, steps: int, codec: str) -> None:
    """Every rank's averaged buckets equal the pure-PyTorch reference fed every rank's local
    gradients, bit for bit."""
    total = sum(int(np.prod(s)) for s in layout["shapes"])
    dumps = [load_dump(f"{dump}.rank{r}", total, steps) for r in range(world)]
    for index, (bucket, slices) in enumerate(zip(layout["buckets"], bucket_slices(layout))):
        n = sum(b - a for a, b in slices)
        shapes = [layout["shapes"][p] for p in bucket]
        identity = _C.bucket_identity(index, torch.zeros(n), shapes) & MASK
        spec = trainer_codec(codec)
        if codec == "q4":
            ref = reference.Q4TwoPhase(world, n, seed=0)
        elif codec == "topk-q4warmup":
            ref = reference.TopKQ4Warmup(world, n, spec.ratio, spec.warmup_steps, seed=0)
        elif codec == "topk-dgc":
            ref = reference.TopKDgc(world, n, spec.ratio, spec.momentum, spec.momentum_masking, spec.clip_norm,
                                    spec.warmup_steps, spec.warmup_stages)
        else:
            ref = reference.TopKExact(world, n, 0.01)
        for step in range(steps):
            grads = [torch.cat([dumps[r][0][step, a:b] for a, b in slices]) for r in range(world)]
            if codec in ("q4", "topk-q4warmup"):
                expect = ref.step(grads, step, identity)
            else:
                expect = ref.step(grads, step) if codec == "topk-dgc" else ref.step(grads)
            for r in range(world):
                got = torch.cat([dumps[r][1][step, a:b] for a, b in slices])
                assert torch.equal(got.view(torch.int32), expect.view(torch.int32)), \
                    f"rank {r} step {step} bucket {index}: {int((got != expect).sum())} elements differ"

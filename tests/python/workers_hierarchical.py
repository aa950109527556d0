"""Per-rank bodies of the hierarchical tests: L ranks per simulated node over real Gloo groups."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import gradcomp.torch as gt
from gradcomp import _C
from gradcomp.ddp import _node_transport

import reference
from workers_common import codec, flat, grad, reduce_steps, train

MASK = 0xFFFFFFFF


def q4_payload_bytes(n: int, block: int = 64) -> int:
    """docs/format.md: a 64-byte header, one fp32 scale per block and two codes per byte, each
    section padded to 16 bytes."""
    align16 = lambda b: -(-b // 16) * 16  # noqa: E731
    return 64 + align16(4 * -(-n // block)) + align16(-(-n // 2))


class HierarchicalReference:
    """The three steps in plain PyTorch on this rank: a mean reduce-scatter inside the node (as
    the node's transport rounds it: Gloo scales by 1 / L, then a SUM reduce-scatter; shared
    memory adds x * (1 / L) in local-rank order in fp32), the flat reference of this local rank's
    shard across nodes with random bits keyed by global ranks, an allgather inside the node."""

    def __init__(self, rank, world, local, n, make_flat, intra, inter, transport):
        self.local, self.nodes, self.n, self.intra, self.inter = local, world // local, n, intra, inter
        self.transport, self.rank = transport, rank
        self.shard = -(-n // local)
        keys = [node * local + rank % local for node in range(self.nodes)]
        self.flat = make_flat(self.nodes, self.shard, keys)

    def step(self, g, *args):
        x = torch.zeros(self.local * self.shard)
        x[: self.n] = g
        if self.transport == "group":
            x.mul_(1.0 / self.local)
            mine = torch.empty(self.shard)
            dist.reduce_scatter_tensor(mine, x, group=self.intra)
        else:
            everyone = [torch.empty_like(x) for _ in range(self.local)]
            dist.all_gather(everyone, x, group=self.intra)
            l = self.rank % self.local
            mine = torch.zeros(self.shard)
            for other in everyone:
                mine = mine + other[l * self.shard:(l + 1) * self.shard] * (1.0 / self.local)
        shards = [torch.empty(self.shard) for _ in range(self.nodes)]
        dist.all_gather(shards, mine, group=self.inter)
        reduced = self.flat.step(shards, *args)
        full = torch.empty(self.local * self.shard)
        dist.all_gather_into_tensor(full, reduced.contiguous(), group=self.intra)
        return full[: self.n]


def equality(rank, world, local, n, transport):
    """The hook with node groups averages each bucket to the bits of the three-step reference;
    the bytes leaving the node follow the documented formula."""
    intra, inter = gt.node_groups(None, local)
    shm = _node_transport(intra, transport)
    nodes = world // local
    out = {}
    for name in ("q4", "topk", "topk_q4warmup"):
        spec = codec(name)
        core = _C.DdpHook(dist.group.WORLD, spec._options(), intra, inter, shm)
        shapes = [[n]]
        bucket_id = _C.bucket_identity(0, torch.zeros(n), shapes) & MASK
        if name == "q4":
            make = lambda w, m, keys: reference.Q4TwoPhase(w, m, seed=5, key_ranks=keys)  # noqa: E731
        elif name == "topk":
            make = lambda w, m, keys: reference.TopKExact(w, m, 0.01)  # noqa: E731
        else:
            make = lambda w, m, keys: reference.TopKQ4Warmup(w, m, spec.ratio, spec.warmup_steps,  # noqa: E731
                                                             seed=5, key_ranks=keys)
        ref = HierarchicalReference(rank, world, local, n, make, intra, inter, transport)
        for step in range(5):
            expect = ref.step(grad(rank, step, n), step, bucket_id) if name != "topk" else ref.step(grad(rank, step, n))
            bucket = grad(rank, step, n)
            core.reduce_bucket(bucket, 0, shapes)
            if not torch.equal(bucket.view(torch.int32), expect.view(torch.int32)):
                diff = (bucket - expect).abs()
                raise AssertionError(f"{name} step {step}: {int((diff > 0).sum())} elements differ, "
                                     f"max {diff.max().item()}")
        stats = core.last_step_stats()
        out[name] = stats
        if name == "q4":
            shard = -(-n // local)
            chunk = max(64, -(-(-(-shard // nodes)) // 64) * 64)
            expect_inter = 2 * (nodes - 1) * q4_payload_bytes(chunk)
            expect_intra = 2 * (local - 1) * shard * 4 + 4 * (local - 1)  # + the agreement word
            assert stats["inter_node_bytes"] == expect_inter, (stats, expect_inter)
            assert stats["bytes_sent"] == expect_inter + expect_intra, (stats, expect_intra)
    return out


def checkpoint(rank, world, local):
    """A hierarchical hook's state resumes bit-identically, records the ranks per node, and is
    refused by a hook of another topology; both DDP routes agree with node groups."""
    intra, inter = gt.node_groups(None, local)
    options = codec("q4")._options()

    def run(core, steps):
        return reduce_steps(core, rank, steps)

    full = run(_C.DdpHook(dist.group.WORLD, options, intra, inter), range(6))
    first = _C.DdpHook(dist.group.WORLD, options, intra, inter)
    run(first, range(3))
    saved = first.state_dict()
    assert saved["local_world_size"] == local, saved["local_world_size"]
    second = _C.DdpHook(dist.group.WORLD, options, intra, inter)
    second.load_state_dict(saved)
    for a, b in zip(full[3:], run(second, range(3, 6))):
        assert torch.equal(a, b), f"resumed hook differs: max {(a - b).abs().max().item()}"
    flat_hook = gt.HookState(codec("q4"), local_world_size=1)
    try:
        flat_hook.load_state_dict(saved)
    except RuntimeError as e:
        assert f"{local} ranks per node; this job has 1" in str(e), str(e)
    else:
        raise AssertionError("a flat hook loaded a hierarchical state")

    a, _, ha = train(rank, world, "register", "q4", 4, local_world_size=local)
    b, _, hb = train(rank, world, "standard", "q4", 4, local_world_size=local)
    fa, fb = flat(a), flat(b)
    assert torch.isfinite(fa).all() and torch.equal(fa, fb), "routes differ with node groups"
    sa, sb = ha.stats()["total"], hb.stats()["total"]
    assert sa["bytes_sent"] == sb["bytes_sent"] and 0 < sa["inter_node_bytes"] < sa["bytes_sent"]
    # Without compression the node groups go unused: bit-identical to DDP without a hook.
    c, _, _ = train(rank, world, "register", "none", 3, local_world_size=local)
    d, _, _ = train(rank, world, "ddp", None, 3)
    assert torch.equal(flat(c), flat(d)), "NoCompression with node groups differs from DDP"
    return sa


def layout_mismatch(rank, world, local):
    """One rank with another bucket: every rank raises at once, naming it."""
    intra, inter = gt.node_groups(None, local)
    core = _C.DdpHook(dist.group.WORLD, codec("q4")._options(), intra, inter)
    n = 1064 if rank == world - 1 else 1000
    start = time.monotonic()
    try:
        core.reduce_bucket(torch.ones(n), 0, [[1000]])
    except RuntimeError as e:
        assert "layout mismatch" in str(e) and f"rank {world - 1} has bucket" in str(e), str(e)
        assert time.monotonic() - start < 20
        return str(e)
    raise AssertionError("no layout mismatch raised")


def bad_local_world_size(rank, world):
    for bad, what in ((3, "does not divide"), (0, "positive number"), (True, "positive number")):
        try:
            gt.node_groups(None, bad)
        except ValueError as e:
            assert what in str(e), str(e)
        else:
            raise AssertionError(f"local_world_size={bad!r} accepted")
    return True

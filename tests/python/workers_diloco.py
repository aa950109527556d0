"""Per-rank bodies of the DiLoCo tests: real Gloo ranks training an MLP with AdamW inner steps, checked
against DiLoCo written out in plain PyTorch over the reference q4 allreduce (reference.py)."""
from __future__ import annotations

import io
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from reference import Q4TwoPhase, q2_encode, q4_encode, streaming_merge
from workers_hierarchical import HierarchicalReference

SEED = 7


def make_model(seed=0):
    """Each rank passes its own seed: DiLoCo's broadcast, and its ordering before the anchors are read
    (on CUDA: an event, not a host wait), must make them equal; with equal seeds a missing one is invisible."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 33), nn.ReLU(), nn.Linear(33, 47), nn.ReLU(), nn.Linear(47, 5))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def inner_step(model, opt, rank, t, dev):
    x, y = batch(rank, t)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


class Reference:
    """DiLoCo on this rank in plain PyTorch: its own model and AdamW; at a fragment's sync every rank's
    outer gradient (all-gathered) goes through the reference q4 allreduce (every rank's residuals kept
    here; or the hierarchical reference), then Nesterov SGD written as separate roundings."""

    def __init__(self, rank, world, split, inner_steps, lr=0.7, mu=0.9, local=1, dev="cpu", q2=False):
        self.rank, self.world, self.split, self.h, self.lr, self.mu = rank, world, split, inner_steps, lr, mu
        self.q2 = q2
        self.local, self.dev = local, dev
        self.model = make_model(0).to(dev)  # rank 0's model: what the broadcast gives every rank
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        params = list(self.model.parameters())
        self.frag_params = [[params[i] for i in frag] for frag in split]
        self.anchor = [torch.cat([p.detach().reshape(-1).float().cpu() for p in ps]) for ps in self.frag_params]
        self.buf = [torch.zeros_like(a) for a in self.anchor]
        self.rounds = [0] * len(split)
        self.reducers = {}
        if local > 1:
            self.groups = gt.node_groups(None, local)

    def _mean(self, f, g):
        n = g.numel()
        if self.local > 1:
            if f not in self.reducers:
                make = lambda w, m, keys: Q4TwoPhase(w, m, seed=SEED, key_ranks=keys)  # noqa: E731
                self.reducers[f] = HierarchicalReference(self.rank, self.world, self.local, n, make,
                                                         self.groups[0], self.groups[1], "group")
            return self.reducers[f].step(g, self.rounds[f], f)
        everyone = [torch.empty(n) for _ in range(self.world)]
        dist.all_gather(everyone, g)
        if f not in self.reducers:
            self.reducers[f] = Q4TwoPhase(self.world, n, seed=SEED, encode=q2_encode if self.q2 else q4_encode)
        return self.reducers[f].step(everyone, self.rounds[f], f)

    def step(self, t):
        inner_step(self.model, self.opt, self.rank, t, self.dev)
        for f, ps in enumerate(self.frag_params):
            if t % self.h != f * self.h // len(self.split):
                continue
            now = torch.cat([p.detach().reshape(-1).float().cpu() for p in ps])
            mean = self._mean(f, self.anchor[f] - now)
            if torch.isfinite(mean).all():
                self.buf[f] = self.buf[f] * self.mu + mean
                update = mean + self.buf[f] * self.mu
                self.anchor[f] = self.anchor[f] - update * self.lr
                self.rounds[f] += 1
            at = 0
            with torch.no_grad():
                for p in ps:
                    p.copy_(self.anchor[f][at:at + p.numel()].view_as(p))
                    at += p.numel()


class OverlapReference(Reference):
    """Streaming DiLoCo's overlap in plain PyTorch: the mean of the outer gradient taken at a fragment's sync
    point is computed at once (the reference's allreduce), but the outer step and the merge
    (reference.streaming_merge) wait tau inner steps, as gradcomp's background round does. Eager: at the sync
    point the fragment takes this rank's own outer step at once (on a copy of the momentum buffer) and trains
    on from it; the merge adds global - eager to the parameters instead of mixing."""

    def __init__(self, rank, world, split, inner_steps, tau, alpha, eager=False, dev="cpu"):
        super().__init__(rank, world, split, inner_steps, dev=dev)
        self.tau, self.alpha, self.eager, self.pending = tau, alpha, eager, {}

    def _write(self, f, values):
        at = 0
        with torch.no_grad():
            for p in self.frag_params[f]:
                p.copy_(values[at:at + p.numel()].view_as(p))
                at += p.numel()

    def step(self, t):
        inner_step(self.model, self.opt, self.rank, t, self.dev)
        for f, (mean, merge, eager) in list(self.pending.items()):
            if merge != t:
                continue
            del self.pending[f]
            ps = self.frag_params[f]
            now = torch.cat([p.detach().reshape(-1).float().cpu() for p in ps])
            if torch.isfinite(mean).all():
                self.buf[f] = self.buf[f] * self.mu + mean
                update = mean + self.buf[f] * self.mu
                self.anchor[f] = self.anchor[f] - update * self.lr
                self.rounds[f] += 1
                merged = now + (self.anchor[f] - eager) if self.eager else streaming_merge(now, self.anchor[f],
                                                                                            self.alpha)
            else:
                merged = self.anchor[f]
            self._write(f, merged)
        for f, ps in enumerate(self.frag_params):
            if t % self.h != f * self.h // len(self.split):
                continue
            now = torch.cat([p.detach().reshape(-1).float().cpu() for p in ps])
            own = self.anchor[f] - now
            eager = None
            if self.eager:
                buf = self.buf[f] * self.mu + own
                eager = self.anchor[f] - (own + buf * self.mu) * self.lr
                self._write(f, eager)
            self.pending[f] = (self._mean(f, own), t + self.tau, eager)


def overlapped_trains_like_the_reference(rank, world, eager=False, device="cpu"):
    """overlap_steps (tau) = 2 and mixing (alpha) = 0.5 (eager: alpha 0 and eager updates) over two fragments
    equal OverlapReference bit for bit at every step; a state_dict taken with a round in flight holds it (and
    eager: this rank's eager anchor), and loading it back mid-overlap changes nothing. DiLoCo gets a group of
    its own: the reference's all_gathers run on the default one while gradcomp's round runs in the background.
    device "cuda": a CUDA model with the v2 kernels (tau > 0 on CUDA needs the outer step on the device)."""
    h, fragments, tau, alpha = 6, 2, 2, 0.0 if eager else 0.5
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    group = dist.new_group(list(range(world)))
    model = make_model(rank).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    codec = gradcomp.Q4(seed=SEED, kernels="v2") if device == "cuda" else gradcomp.Q4(seed=SEED)
    d = gt.diloco(model, opt, codec, inner_steps=h, fragments=fragments, overlap_steps=tau,
                  mixing=alpha, eager=eager, process_group=group)
    ref = OverlapReference(rank, world, d.fragments(), h, tau, alpha, eager, dev=dev)
    steps = 3 * h + tau + 1
    for t in range(1, steps + 1):
        inner_step(model, opt, rank, t, dev)
        ref.step(t)
        got, want = flat(model), flat(ref.model)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"step {t}: differs from the reference by {(got - want).abs().max().item()}"
        if t == h + 1:  # fragment 0 synced after step 6, merges after step 8
            state = d.local_state_dict()
            assert state["pending"].tolist() == [0, h + tau, 1], state["pending"]
            assert torch.equal(state["pending_eager.0"], ref.pending[0][2] if eager else torch.empty(0)), \
                "the state's eager anchor is not this rank's own outer step"
            d.load_local_state_dict(state)
    stats = d.stats()
    # Counted when their allreduce is joined: the round started after the last step is still in flight.
    assert stats["rounds"] == sum(ref.rounds) and len(ref.pending) == 1, (stats, ref.rounds)
    assert stats["background_seconds"] > 0 and 0 <= stats["wait_seconds"] <= stats["seconds"], stats
    return stats


def trains_like_the_reference(rank, world, variant, device="cpu"):
    """Several rounds of DiLoCo with q4 outer gradients (variant "q2": gradcomp.Q2's; "q2-v2": Q2 on the v2
    kernels, the only ones it has on CUDA) equal the plain-PyTorch reference bit for bit, on every rank, and
    every rank holds the same parameters after a sync."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    h, fragments, local = 3, 1, 1
    if variant == "fragments":
        h, fragments = 4, 2
    if variant == "hierarchical":
        local = 2
    model = make_model(rank).to(dev)
    assert rank == 0 or not torch.equal(flat(model), flat(make_model(0))), "the ranks must start apart"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    q2 = variant in ("q2", "q2-v2")
    kernels = "v2" if variant == "q2-v2" else "default"
    codec = gradcomp.Q2(seed=SEED, kernels=kernels) if q2 else gradcomp.Q4(seed=SEED)
    d = gt.diloco(model, opt, codec, inner_steps=h, fragments=fragments, local_world_size=local)
    assert torch.equal(flat(model), flat(make_model(0))), "DiLoCo did not start every rank from rank 0's model"
    split = d.fragments()
    assert sorted(i for frag in split for i in frag) == list(range(len(list(model.parameters())))), split
    assert len(split) == fragments
    ref = Reference(rank, world, split, h, local=local, dev=dev, q2=q2)
    steps = 3 * h + 1
    for t in range(1, steps + 1):
        inner_step(model, opt, rank, t, dev)  # the optimizer's post-step hook runs DiLoCo's step
        ref.step(t)
        got, want = flat(model), flat(ref.model)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"step {t}: differs from the reference by {(got - want).abs().max().item()}"
        if t % h == 0 and fragments == 1:
            everyone = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(everyone, got)
            assert all(torch.equal(e, got) for e in everyone), f"step {t}: ranks differ after the sync"
    stats = d.stats()
    assert stats["inner_steps"] == steps and stats["rounds"] == sum(ref.rounds), (stats, ref.rounds)
    assert stats["bytes_sent"] > 0 and stats["nonfinite_rounds"] == 0, stats
    if local == 1:
        assert stats["ratio"] > 3.5, stats  # q4 against an fp32 ring allreduce, small buckets' headers included
    text = d.metrics_text()
    for line in ("gradcomp_steps_total{", "gradcomp_buckets_total{", "gradcomp_sent_bytes_total{"):
        assert line in text, text
    values = {l.split("{")[0]: float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l and not l.startswith("#")}
    assert values["gradcomp_steps_total"] == steps and values["gradcomp_buckets_total"] == stats["rounds"], values
    assert 'front_end="diloco"' in text and ('codec="q2"' if q2 else 'codec="q4"') in text, text
    if variant == "plain" and world == 2 and device == "cpu":
        fp32_baseline_equals_lossless_diloco(rank)
    return stats


def fp32_baseline_equals_lossless_diloco(rank):
    """bench/diloco_fp32.py (the convergence runs' "-none" baseline: DiLoCo with fp32 outer gradients, which
    splits a loss gap into the codec's part and DiLoCo's own) equals gradcomp's DiLoCo with a lossless codec
    (top-k of every element, fp32 values: nothing dropped, no residual) bit for bit at W = 2, over 3 rounds."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from diloco_fp32 import Fp32DiLoCo

    h, lr, mu = 3, 1.0, 0.3
    base_model, lossless_model = make_model(rank), make_model(rank)
    base_opt = torch.optim.AdamW(base_model.parameters(), lr=1e-2)
    lossless_opt = torch.optim.AdamW(lossless_model.parameters(), lr=1e-2)
    base = Fp32DiLoCo(base_model.parameters(), base_opt, h, lr, mu, True)
    gt.diloco(lossless_model, lossless_opt, gradcomp.TopK(ratio=1.0, seed=SEED), inner_steps=h, outer_lr=lr,
              outer_momentum=mu)
    cpu = torch.device("cpu")
    for t in range(1, 3 * h + 2):
        inner_step(base_model, base_opt, rank, t, cpu)
        inner_step(lossless_model, lossless_opt, rank, t, cpu)
        got, want = flat(base_model), flat(lossless_model)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"step {t}: the fp32 baseline differs from lossless DiLoCo by {(got - want).abs().max().item()}"
    assert base.stats()["bytes_sent"] == 3 * 4 * got.numel()  # 3 rounds of a ring allreduce's 2 (W - 1) / W


def nan_round_resets_every_rank(rank, world):
    """A rank whose inner steps diverge makes the mean non-finite: every rank goes back to the round's
    start, the outer state and the residuals stay as they were."""
    model = make_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = gt.diloco(model, opt, gradcomp.Q4(seed=SEED), inner_steps=2)
    start = flat(model)  # rank 0's, broadcast
    inner_step(model, opt, rank, 1, "cpu")
    if rank == world - 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    before = d.local_state_dict()
    inner_step(model, opt, rank, 2, "cpu")
    assert torch.equal(flat(model), start), "parameters not reset to the round's start"
    after = d.local_state_dict()
    assert d.stats()["nonfinite_rounds"] == 1 and after["rounds"].tolist() == [0], d.stats()
    for key in ("anchor.0", "momentum.0"):
        assert torch.equal(before[key], after[key]), key
    for key in after:
        if key.startswith("residual."):
            assert not after[key].any(), f"{key} changed on a non-finite round"
    return True


def run_steps(model, opt, rank, steps):
    for t in steps:
        inner_step(model, opt, rank, t, "cpu")
    return flat(model)


def resumes_bit_for_bit(rank, world, path):
    """Saving mid-round (model, AdamW, DiLoCo) and resuming gives the parameters of an unbroken run."""
    options = dict(inner_steps=3, fragments=2)
    model = make_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gt.diloco(model, opt, gradcomp.Q4(seed=SEED), **options)
    straight = run_steps(model, opt, rank, range(1, 11))

    model = make_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = gt.diloco(model, opt, gradcomp.Q4(seed=SEED), **options)
    run_steps(model, opt, rank, range(1, 6))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "diloco": d.state_dict()}, buf)
    torch.save(d.local_state_dict(), f"{path}.{rank}")  # the format states had before they were keyed by rank
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)

    model = make_model(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = gt.diloco(model, opt, gradcomp.Q4(seed=SEED), **options)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    d.load_state_dict(saved["diloco"])
    resumed = run_steps(model, opt, rank, range(6, 11))
    assert torch.equal(resumed.view(torch.int32), straight.view(torch.int32)), \
        f"resumed run differs by {(resumed - straight).abs().max().item()}"
    return True


def refuses_what_it_cannot_do(rank, world, path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = gt.diloco(model, opt, gradcomp.Q4(seed=SEED), inner_steps=3, fragments=2)
    problems = {}
    try:
        d.load_state_dict(torch.load(f"{path}.0", weights_only=True))
    except RuntimeError as e:
        problems["world"] = str(e)
    for name, call in {
        "ddp": lambda: gt.diloco(nn.parallel.DistributedDataParallel(make_model()), None),
        "codec": lambda: gt.diloco(make_model(), None, gradcomp.NoCompression()),
        "inner_steps": lambda: gt.diloco(make_model(), None, inner_steps=0),
        "momentum": lambda: gt.diloco(make_model(), None, outer_momentum=1.5),
        "eager": lambda: gt.diloco(make_model(), None, overlap_steps=0, eager=True),
        "eager_mixing": lambda: gt.diloco(make_model(), None, inner_steps=4, overlap_steps=1, mixing=0.5, eager=True),
        "overlap": lambda: gt.diloco(make_model(), None, inner_steps=4, fragments=2, overlap_steps=2),
    }.items():
        try:
            call()
        except (ValueError, RuntimeError) as e:
            problems[name] = str(e)
    assert "group of 2 ranks, this group has 3" in problems.get("world", ""), problems
    assert "replaces DDP" in problems.get("ddp", ""), problems
    assert "gradcomp.Q4, gradcomp.Q2 or gradcomp.TopK" in problems.get("codec", ""), problems
    assert "inner_steps" in problems.get("inner_steps", ""), problems
    assert "outer_momentum must be in [0, 1)" in problems.get("momentum", ""), problems
    assert "eager updates (eager=True) need overlap_steps (tau) > 0" in problems.get("eager", ""), problems
    assert "eager updates take mixing (alpha) = 0, got 0.5" in problems.get("eager_mixing", ""), problems
    assert "overlap_steps (tau) = 2 must be below" in problems.get("overlap", ""), problems
    # Damaged or foreign states are refused whole, naming what is wrong; the DiLoCo keeps working.
    good = d.local_state_dict()
    bad = {
        "inner_step is -3, not a count": {**good, "inner_step": torch.tensor([-3])},
        "no 'anchor.1'": {k: v for k, v in good.items() if k != "anchor.1"},
        "is a str, not a tensor": {**good, "seed": "7"},
        "saved with inner_steps (H) 4, this run has 3": {**good, "inner_steps": torch.tensor([4])},
        "its format is 9": {**good, "format": torch.tensor([9])},
        "anchor.0 is not a 1-D Float tensor": {**good, "anchor.0": good["anchor.0"].double()},
    }
    bad_keyed = {"no entry for this rank (rank7); it holds ['rank99']": {"rank99": good}}
    for what, state in [*bad.items(), *bad_keyed.items()]:
        try:
            d.load_state_dict(state)
        except (RuntimeError, ValueError) as e:
            assert what.replace("rank7", f"rank{rank}") in str(e), (what, str(e))
        else:
            raise AssertionError(f"loaded a state where {what}")
    run_steps(model, opt, rank, range(1, 4))
    assert d.stats()["rounds"] == 2, d.stats()  # both fragments synced once after three steps
    return True


def resumes_through_distributed_checkpoint(rank, world, path):
    """torch.distributed.checkpoint saves the model, AdamW and DiLoCo (as a Stateful: every rank's residuals,
    anchors' round and round in flight under a key of its own) mid-overlap with eager updates, where the
    ranks' states differ (their residuals and eager steps); a fresh job loads them and goes on bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = dict(inner_steps=4, fragments=2, overlap_steps=1, eager=True)

    def job(steps, load=False, save=False):
        model = make_model(rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # Mid-round the model and AdamW are each rank's own too (no shards, no average yet): they go under a
        # key of each rank's own as well. get_state_dict gives AdamW's state its shapes for DCP to load into by
        # stepping it with lr 0: before DiLoCo hooks the optimizer, which would count that step.
        msd, osd = get_state_dict(model, opt)
        d = gt.diloco(model, opt, gradcomp.Q4(seed=SEED), **options)
        state = {f"rank{rank}": {"model": msd, "optim": osd}, "diloco": d}
        if load:
            dcp.load(state, checkpoint_id=path)
            mine = state[f"rank{rank}"]
            set_state_dict(model, opt, model_state_dict=mine["model"], optim_state_dict=mine["optim"])
        run_steps(model, opt, rank, steps)
        if save:
            local = d.local_state_dict()
            msd, osd = get_state_dict(model, opt)
            dcp.save({f"rank{rank}": {"model": msd, "optim": osd}, "diloco": d}, checkpoint_id=path)
            return flat(model), local
        d.flush()
        return flat(model), d.local_state_dict()

    straight, _ = job(range(1, 12))
    _, saved = job(range(1, 7), save=True)  # fragment 1 synced after step 6, merges after step 7
    assert saved["pending"].tolist() == [1, 7, 1], saved["pending"]
    everyone = [None] * world
    dist.all_gather_object(everyone, {k: v for k, v in saved.items() if k.startswith(("residual.", "pending_eager"))})
    for key, value in everyone[0].items():
        assert all(key in o for o in everyone), key
    assert any(not torch.equal(everyone[0][k], everyone[1][k]) for k in everyone[0] if k.startswith("residual.")), \
        "the ranks' residuals should differ"
    assert not torch.equal(everyone[0]["pending_eager.0"], everyone[1]["pending_eager.0"])
    resumed, state = job(range(7, 12), load=True)
    assert torch.equal(resumed.view(torch.int32), straight.view(torch.int32)), \
        f"resumed run differs by {(resumed - straight).abs().max().item()}"
    assert state["inner_step"].item() == 11, state["inner_step"]
    return True

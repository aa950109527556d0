"""Per-rank bodies of the FSDP2 tests: ``fully_shard`` on Gloo/CPU ranks with gradcomp's reduce-scatter,
checked against the pure-PyTorch reference (reference.py) of the same payloads."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import gradcomp
import gradcomp.torch as gt
from reference import Q4ReduceScatter

SEED = 11


def make_model():
    torch.manual_seed(0)
    # Rows of 33 outputs: FSDP pads dim 0 to a multiple of the world size, and each rank's row is
    # no whole number of q4 blocks.
    return nn.Sequential(nn.Linear(20, 33), nn.ReLU(), nn.Linear(33, 47), nn.ReLU(), nn.Linear(47, 5))


def shard(model, mp=None, mesh=None, reshard=None, layers=(nn.Linear,)):
    """fully_shard each of the model's layers of the types `layers`, then the model; the policy, mesh and
    reshard_after_forward passed on when given (else FSDP's defaults)."""
    kwargs = {"mp_policy": mp} if mp is not None else {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if reshard is not None:
        kwargs["reshard_after_forward"] = reshard
    for layer in model:
        if isinstance(layer, layers):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def hsdp_mesh():
    """2 replicas x 2 shards of the 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).float(), y)


def train_losses(model, opt, rank, steps):
    """Trains on three batches in turn; returns the losses."""
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step % 3)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def buckets_of(model):
    """Each fully_shard module's bucket index and its own Linear's parameters, as gradcomp.torch.fsdp
    numbers them (model.modules() order)."""
    out = []
    for i, m in enumerate(x for x in model.modules() if isinstance(x, FSDPModule)):
        if isinstance(m, nn.Linear):
            out.append((i, m))
    return out


def rows(params_grads, world):
    """FSDP's reduce-scatter input from full gradients: each gradient padded along dim 0 to a multiple
    of the world size and cut into `world` chunks; row r is every chunk r, concatenated."""
    per_row = [[] for _ in range(world)]
    for g in params_grads:
        pad = -g.shape[0] % world
        padded = torch.cat([g, g.new_zeros((pad,) + tuple(g.shape[1:]))]) if pad else g
        for r, chunk in enumerate(padded.chunk(world)):
            per_row[r].append(chunk.reshape(-1))
    return torch.stack([torch.cat(c) for c in per_row])


def unrows(reduced, shapes, world):
    """The full gradients from every rank's reduced row (the inverse of rows)."""
    out, at = [], 0
    for shape in shapes:
        padded0 = shape[0] + (-shape[0] % world)
        n = padded0 // world * int(torch.Size(shape[1:]).numel())
        chunks = [reduced[r][at:at + n].reshape((padded0 // world,) + tuple(shape[1:])) for r in range(world)]
        out.append(torch.cat(chunks)[:shape[0]])
        at += n
    return out


def all_grads(grads):
    """Every rank's flat gradients, in rank order."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    out = []
    for f in gathered:
        parts, at = [], 0
        for g in grads:
            parts.append(f[at:at + g.numel()].reshape(g.shape))
            at += g.numel()
        out.append(parts)
    return out


class ReferenceTrainer:
    """The same model unsharded on every rank, its gradients reduced by the reference of gradcomp's
    reduce-scatter over every rank's gradients, then the same optimizer step."""

    def __init__(self, world, divide_factor=None, nan=None, device="cpu"):
        self.device = torch.device(device)
        self.model = make_model().to(self.device)
        self.world = world
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        layers = [m for m in self.model if isinstance(m, nn.Linear)]
        # model.modules() order: the root (bucket 0, no parameters of its own), then each Linear.
        self.layers = [(i + 1, m) for i, m in enumerate(layers)]
        self.refs = {b: Q4ReduceScatter(world, seed=SEED) for b, _ in self.layers}
        self.divisor = float(world) if divide_factor is None else float(torch.tensor(1.0 / (1.0 / divide_factor)))
        self.divide_factor = divide_factor
        self.nan = nan  # (rank, step): that rank's first input element is NaN at that step

    def step(self, rank, step, micro=1):
        self.opt.zero_grad()
        for m in range(micro):
            x, y = batch(rank * micro + m, step)
            if self.nan == (rank, step):
                x = x.clone()
                x[0, 0] = float("nan")
            loss_of(self.model, x.to(self.device), y.to(self.device)).backward()
        for bucket, layer in self.layers:
            params = list(layer.parameters())
            every = all_grads([p.grad for p in params])
            inputs = [rows([t.cpu() for t in g], self.world) for g in every]
            reduced = self.refs[bucket].step(inputs, step_index(self, bucket), bucket, self.divisor)
            for p, g in zip(params, unrows(reduced, [p.shape for p in params], self.world)):
                p.grad = g.to(self.device)
        self.opt.step()


def residuals(hook):
    return hook.local_state_dict()["reduce_scatter"]["residuals"]


def step_index(trainer, bucket):
    return trainer.refs[bucket].steps


def trains_like_the_reference(rank, world, variant, device="cpu"):
    """FSDP2 + gradcomp q4 for four steps equals the unsharded reference bit for bit; with a NaN on
    one rank at step 2 every rank sees it in its shard of that module and keeps its residual. On
    "cuda" the ranks share one GPU over Gloo and the reference's q4 runs on the CPU."""
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    divide_factor = 5.0 if variant == "premul" else None  # not a world size: FSDP would pass AVG
    micro = 2 if variant == "accumulate" else 1
    nan = (world - 1, 2) if variant == "nan" else None
    model = shard(make_model().to(dev))
    if divide_factor is not None:  # each module's own setting; FSDP then passes PREMUL_SUM(1 / factor)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide_factor)
    hook = gt.fsdp(model, gradcomp.Q4(seed=SEED))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = ReferenceTrainer(world, divide_factor, nan, dev)
    calls, shards, ops = [], [], set()
    original = hook._reduce_scatter

    def counted(output, input, group, op, bucket):
        calls.append(bucket)
        ops.add(getattr(op, "op", op))
        shards.append(output.numel())
        original(output, input, group, op, bucket)

    hook._reduce_scatter = counted
    for step in range(4):
        opt.zero_grad()
        residuals_before = copy.deepcopy(residuals(hook)) if step > 0 else None
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            x, y = batch(rank * micro + m, step)
            if nan == (rank, step):
                x = x.clone()
                x[0, 0] = float("nan")
            loss_of(model, x.to(dev), y.to(dev)).backward()
        if nan is not None and step == nan[1]:
            for _, layer in buckets_of(model):
                assert any(torch.isnan(p.grad.to_local()).any() for p in layer.parameters()), \
                    f"rank {rank}: no NaN reached this rank's shard"
            # Every module's result is non-finite, each counted once (under v2 on CUDA late: at a
            # later call or at the flush stats() makes, the last module's only there).
            step_stats = hook.stats()["step"]
            assert step_stats["nonfinite_buckets"] == len(buckets_of(model)), step_stats
            after = residuals(hook)
            for b, r in residuals_before.items():
                assert torch.equal(after[b], r), f"bucket {b}: residual changed on a non-finite step"
            ref.step(rank, step, micro)  # keeps its residuals alike; the models are not compared now
            return True
        opt.step()
        ref.step(rank, step, micro)
        got = full(model).cpu()
        want = torch.cat([p.detach().reshape(-1) for p in ref.model.parameters()]).cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"step {step}: differs from the reference by {(got - want).abs().max().item()}"
    expected_op = dist.ReduceOp.PREMUL_SUM if divide_factor is not None else dist.ReduceOp.AVG
    assert ops == {expected_op}, ops
    buckets = [b for b, _ in buckets_of(model)][::-1]  # backward reaches the last layer first
    assert calls == buckets * 4, f"reduce-scatter calls {calls}, expected {buckets} per step"
    stats = hook.stats()["total"]
    assert stats["buckets"] == 4 * len(buckets) and stats["bytes_sent"] > 0, stats
    # A step sends (W - 1) q4 payloads of each row per module (the first step also each module's
    # layout agreement); an fp32 reduce-scatter would send 4 bytes per element of the same rows.
    last = shards[-len(buckets):]
    payload = [gradcomp.compress(torch.zeros(n), gradcomp.Q4()).numel() for n in last]
    step_stats = hook.stats()["step"]
    assert step_stats["buckets"] == len(buckets), step_stats
    assert step_stats["bytes_sent"] == (world - 1) * sum(payload), step_stats
    assert step_stats["uncompressed_bytes"] == (world - 1) * 4 * sum(last), step_stats
    assert stats["bytes_sent"] > 4 * step_stats["bytes_sent"], stats
    assert hook.local_state_dict()["reduce_scatter"]["step"] == 4
    # flush(): every verdict is in (the CPU's and v1's at each call; v2 on CUDA: stats() flushed), so
    # it changes no counter, and it may be called again.
    before = hook.stats()
    hook.flush()
    hook.flush()
    assert hook.stats() == before, (before, hook.stats())
    return True


def mixed_precision_reaches_the_comm_in_the_reduce_dtype(rank, world, reduce_dtype):
    """MixedPrecisionPolicy(bf16 params, `reduce_dtype`): the comm receives that dtype, and every
    reduce-scatter's output equals the reference's of every rank's inputs bit for bit (the mean over W
    ranks, rounded once to the reduce dtype: a wrong scale or a second rounding shows), and it trains."""
    reduce = getattr(torch, reduce_dtype)
    bits = torch.int32 if reduce == torch.float32 else torch.int16
    model = shard(make_model(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce))
    hook = gt.fsdp(model, gradcomp.Q4(seed=SEED))
    seen, refs, compared = [], {}, []
    original = hook._reduce_scatter

    def spy(output, input, group, op, bucket):
        seen.append((input.dtype, output.dtype, getattr(op, "op", op)))
        # Every rank's input, exactly (bf16 -> fp32 -> bf16 is lossless), before the collective.
        everyone = [torch.empty(input.numel()) for _ in range(world)]
        dist.all_gather(everyone, input.detach().reshape(-1).float())
        original(output, input, group, op, bucket)
        ref = refs.setdefault(bucket, Q4ReduceScatter(world, seed=SEED))
        rows_in = [e.to(input.dtype).view(world, -1) for e in everyone]
        want = ref.step(rows_in, ref.steps, bucket, float(world))[rank]
        got = output.detach().reshape(-1)
        assert got.dtype == want.dtype and torch.equal(got.view(bits), want.view(bits)), \
            f"bucket {bucket}: differs from the reference by {(got.float() - want.float()).abs().max().item()}"
        compared.append(bucket)

    hook._reduce_scatter = spy
    losses = train_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, 30)
    assert {s[:2] for s in seen} == {(reduce, reduce)}, seen
    assert {s[2] for s in seen} == {dist.ReduceOp.AVG}, seen
    assert len(compared) == 30 * len(buckets_of(model)), compared
    assert losses[-1] < 0.5 * losses[0], losses
    return True


def resumes_bit_for_bit(rank, world, path):
    """Four steps straight equal two steps, a checkpoint (model, optimizer, gradcomp state), a fresh
    job that loads it, and two more steps."""
    def run(steps, state=None):
        model = shard(make_model())
        hook = gt.fsdp(model, gradcomp.Q4(seed=SEED, residual_dtype=torch.bfloat16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            hook.load_state_dict(state["gradcomp"])
        for step in steps:
            opt.zero_grad()
            x, y = batch(rank, step)
            loss_of(model, x, y).backward()
            opt.step()
        return model, {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                       "gradcomp": copy.deepcopy(hook.state_dict())}

    straight, _ = run(range(4))
    _, saved = run(range(2))
    resumed, _ = run(range(2, 4), saved)
    a, b = full(straight), full(resumed)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"resume differs by {(a - b).abs().max()}"
    torch.save(saved["gradcomp"], f"{path}.{rank}")  # {"rank<r>": bytes}
    return True


def refuses_another_world_size(rank, world, path):
    """A 2-rank checkpoint (both ranks' entries, as torch.distributed.checkpoint keeps them) loaded by 3
    ranks: every rank refuses at load, before any collective, saying why; reset_residuals loads it."""
    saved = {}
    for r in range(2):
        saved.update(torch.load(f"{path}.{r}", weights_only=True))
    model = shard(make_model())
    hook = gt.fsdp(model, gradcomp.Q4(seed=SEED, residual_dtype=torch.bfloat16))
    try:
        hook.load_state_dict(saved)
        raise AssertionError("a 2-rank state loaded into 3 ranks")
    except ValueError as e:
        want = "no entry for this rank (rank2)" if rank == 2 else "saved by a group of 2 ranks and this group has 3"
        assert want in str(e), str(e)
    hook.load_state_dict({f"rank{rank}": saved[f"rank{rank % 2}"]}, reset_residuals=True)
    x, y = batch(rank, 0)
    loss_of(model, x, y).backward()
    assert hook.local_state_dict()["reduce_scatter"]["step"] == 3  # the saved step (2), then this one
    return True


def refuses_what_it_cannot_do(rank, world):
    model = make_model()
    try:
        gt.fsdp(model, gradcomp.Q4())
        raise AssertionError("a model without fully_shard was accepted")
    except ValueError as e:
        assert "no fully_shard module" in str(e)
    model = shard(model)
    try:
        gt.fsdp(model, gradcomp.NoCompression())
        raise AssertionError("NoCompression was accepted")
    except ValueError as e:
        assert "FSDP's own reduce-scatter" in str(e)
    try:
        gt.fsdp(model, gradcomp.TopK(ratio=0.01, momentum=0.9))
        x, y = batch(rank, 0)
        loss_of(model, x, y).backward()
        raise AssertionError("top-k momentum correction was accepted for a reduce-scatter")
    except RuntimeError as e:
        assert "without remedies" in str(e), str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gt.fsdp(shard(make_model()), gradcomp.TopK(ratio=0.01),
                optimizer=torch.optim.AdamW(make_model().parameters()))
    assert any("TopK with an adaptive optimizer" in str(w.message) for w in caught), [str(w.message) for w in caught]
    return True


def topk_trains(rank, world):
    """Top-k per row (each rank's shard gets the largest entries of every sender's row) trains the
    model; the bytes are those of the payloads."""
    model = shard(make_model())
    hook = gt.fsdp(model, gradcomp.TopK(ratio=0.1))
    losses = train_losses(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rank, 40)
    assert losses[-1] < 0.5 * losses[0], losses
    stats = hook.stats()["total"]
    assert stats["uncompressed_bytes"] > 3 * stats["bytes_sent"] > 0, stats
    return True


def hsdp_trains_like_the_reference(rank, world):
    """HSDP on 2 replicas x 2 shards: fully_shard over mesh["shard"] with FSDP's own reduce-scatter inside
    the replica, gradcomp's q4 allreduce across replicas; three steps equal the unsharded reference (the
    shard mean in fp32, then the two-phase q4 allreduce reference across replicas) bit for bit."""
    from reference import Q4TwoPhase

    mesh = hsdp_mesh()
    model = shard(make_model(), mesh=mesh["shard"])
    replicate = mesh["replicate"].get_group()
    hook = gt.fsdp(model, gradcomp.Q4(seed=SEED), replicate_group=replicate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    ref_model = make_model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    layers = [(i + 1, m) for i, m in enumerate(m for m in ref_model if isinstance(m, nn.Linear))]
    refs = {}  # (bucket, shard) -> the allreduce reference across the two replicas
    for step in range(3):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss_of(model, x, y).backward()
        opt.step()

        ref_opt.zero_grad()
        loss_of(ref_model, x, y).backward()
        for bucket, layer in layers:
            params = list(layer.parameters())
            every = [rows(g, 2) for g in all_grads([p.grad for p in params])]  # by global rank
            reduced = []
            for s in range(2):
                means = [(every[2 * n][s] + every[2 * n + 1][s]) / 2 for n in range(2)]  # inside replica n
                ref = refs.setdefault((bucket, s), Q4TwoPhase(2, means[0].numel(), seed=SEED))
                reduced.append(ref.step(means, step, bucket))
            for p, g in zip(params, unrows(reduced, [p.shape for p in params], 2)):
                p.grad = g
        ref_opt.step()
        got, want = full(model), torch.cat([p.detach().reshape(-1) for p in ref_model.parameters()])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
            f"step {step}: differs from the reference by {(got - want).abs().max().item()}"
    stats = hook.stats()
    assert set(stats) == {"step", "total", "replicate"}, stats.keys()
    assert stats["total"]["buckets"] == 3 * len(layers) and stats["total"]["bytes_sent"] > 0, stats
    state = hook.local_state_dict()
    assert "reduce_scatter" not in state and state["replicate"]["step"] == 3, state.keys()
    return True


def metrics_count_each_step_once(rank, world):
    """FSDP's metrics with both collectives (reduce-scatter and replica all-reduce): one series per
    metric, steps counted once, the buckets of both."""
    from prometheus_client.parser import text_string_to_metric_families

    mesh = hsdp_mesh()
    model = shard(make_model(), mesh=mesh["shard"])
    hook = gt.fsdp(model, gradcomp.Q4(seed=SEED), replicate_group=mesh["replicate"].get_group(),
                   reduce_scatter=True)
    train_losses(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 3)
    values = {s.name: s.value for f in text_string_to_metric_families(hook.metrics_text()) for s in f.samples
              if not s.name.startswith("gradcomp_bucket_seconds")}
    assert values["gradcomp_steps_total"] == 3, values
    assert values["gradcomp_buckets_total"] == 3 * 3 * 2, values  # 3 modules, 3 steps, 2 collectives
    assert values["gradcomp_sent_bytes_total"] == hook.stats()["total"]["bytes_sent"], values
    return True


def dcp_job(rank, path, make_hook, steps, load=False, save=False):
    """The sharded model under make_hook(model) trained with AdamW over `steps` (each rank's batches);
    the model, the optimizer and the hook loaded first from the torch.distributed.checkpoint at `path`
    (load) and saved there after (save)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = shard(make_model())
    hook = make_hook(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if load:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "gradcomp": hook}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in steps:
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        opt.step()
    if save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "gradcomp": hook}, checkpoint_id=path)
    return model, hook


def resumes_through_distributed_checkpoint(rank, world, path):
    """torch.distributed.checkpoint saves the model, the optimizer and the hook (every rank's residuals,
    each under its own key); a fresh job loads them and goes on bit for bit."""

    def job(steps, **kwargs):
        return dcp_job(rank, path, lambda model: gt.fsdp(model, gradcomp.Q4(seed=SEED)), steps, **kwargs)

    straight, _ = job(range(4))
    _, saved_hook = job(range(2), save=True)
    resumed, hook = job(range(2, 4), load=True)
    a, b = full(straight), full(resumed)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"resume differs by {(a - b).abs().max()}"
    assert hook.local_state_dict()["reduce_scatter"]["step"] == 4
    return True

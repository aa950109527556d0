"""Per-rank bodies of the int8 parameter all-gather tests: ``fully_shard`` on Gloo/CPU ranks with
``gradcomp.torch.fsdp(..., params=gradcomp.Int8())``, every all-gather recorded and checked bit for bit
against the pure-PyTorch reference (reference.int8_all_gather) of every rank's exact shard."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import gradcomp
import gradcomp.torch as gt
from gradcomp._torch_compat import fsdp_in_backward, fsdp_param_group
from reference import int4_roundtrip, int8_all_gather, int8_roundtrip
from workers_fsdp import batch, dcp_job, full, hsdp_mesh, loss_of, make_model, rows, shard

BLOCK = 32


class TwoDtypes(nn.Module):
    """A layer whose weight is fp32 and whose bias is bf16: FSDP all-gathers them as uint8 bytes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.weight = nn.Parameter(torch.randn(33, 20) * 0.1)
        self.bias = nn.Parameter((torch.randn(33) * 0.1).to(torch.bfloat16))

    def forward(self, x):
        return x @ self.weight.t() + self.bias.float()


class Recorder(AllGather):
    """Wraps a module's all-gather comm and keeps every call's group size, phase, input and output."""

    def __init__(self, inner, param_group):
        self.inner, self.param_group, self.calls = inner, param_group, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        before = input_tensor.clone()
        backward = fsdp_in_backward(self.param_group)
        self.inner(output_tensor, input_tensor, group, async_op)
        self.calls.append((group.size(), backward, before, output_tensor.clone()))


def layers_of(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule) and fsdp_param_group(m) is not None]


def install_recorders(model):
    out = {}
    for m in layers_of(model):
        pg = fsdp_param_group(m)
        pg._all_gather_comm = out[m] = Recorder(pg._all_gather_comm, pg)
    return out


def padded_numel(p, world):
    return -(-p.shape[0] // world) * int(torch.Size(p.shape[1:]).numel())


def flats(buffer, nrows, per_row):
    """Each parameter's flat padded tensor from an all-gather output of nrows rows, each row holding
    per_row[i] elements of parameter i in turn."""
    grid, out, at = buffer.view(nrows, -1), [], 0
    for n in per_row:
        out.append(grid[:, at:at + n].reshape(-1))
        at += n
    return out


def check_against_reference(module, recorder, world, param_dtype, group=None, roundtrip=int8_roundtrip):
    """Every shard-group all-gather of the module (over ``group`` of ``world`` ranks, the default group when
    None): its output is the reference of every rank's exact input row, and those rows are the module's
    exact sharded parameters (in the parameter dtype)."""
    params = list(module.parameters(recurse=False)) or [p for p in module.parameters()]
    full = [p.full_tensor().detach() for p in params]
    dtypes = [param_dtype or f.dtype for f in full]
    mixed = len(set(dtypes)) > 1
    runs = [(d, padded_numel(f, world)) for d, f in zip(dtypes, full)] if mixed else None
    shard_calls = [c for c in recorder.calls if c[0] == world]
    assert shard_calls, "no all-gather over the shard group"
    for _, _, inp, out in shard_calls:
        gathered = torch.empty(world * inp.numel(), dtype=inp.dtype)
        dist.all_gather_into_tensor(gathered, inp, group=group)
        per_rank = list(gathered.view(world, -1))
        if not mixed:
            exact = rows([f.to(dtypes[0]) for f in full], world)
            assert torch.equal(torch.stack(per_rank), exact), "the all-gather input is not the exact shard"
        expected = int8_all_gather(per_rank, runs, BLOCK, roundtrip)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), "output differs from the reference"
        assert not torch.equal(out.view(torch.uint8), gathered.view(torch.uint8)), "nothing was quantized"
    return shard_calls


def build(world, case):
    case = case.removeprefix("int4_")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case == "bf16" else None
    reshard = {"reshard_false": False, "reshard_int": 2}.get(case, True)
    model = nn.Sequential(TwoDtypes(), nn.ReLU(), nn.Linear(33, 5)) if case == "two_dtypes" else make_model()
    return shard(model, mp, reshard=reshard, layers=(nn.Linear, TwoDtypes)), (torch.bfloat16 if mp else None)


def run_case(rank, world, case):
    """A case of the int8 all-gather; "int4_<case>": the same with gradcomp.Int4 against int4_roundtrip."""
    model, param_dtype = build(world, case)
    int4 = case.startswith("int4_")
    case = case.removeprefix("int4_")
    codec = gradcomp.Q4(seed=3) if case == "train" else None
    params = (gradcomp.Int4 if int4 else gradcomp.Int8)(block_size=BLOCK)
    hook = gt.fsdp(model, codec, params=params, reduce_scatter=case == "train")
    recorders = install_recorders(model)
    if case == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = batch(0, 0)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < 0.9 * losses[0], losses
        stats = hook.stats()
        ag = stats["all_gather"]["total"]
        assert ag["bytes_sent"] > 0 and ag["ratio"] > 3.0, ag  # fp32 weights: about 32 / 8.5 bits
        assert stats["reduce_scatter"]["total"]["bytes_sent"] > 0
        # Checkpoints hold no quantized weights: the model's state is the exact shards, and the hook's
        # state is the reduce-scatter's alone.
        assert all(torch.equal(v.to_local(), p.to_local()) for v, p in zip(model.state_dict().values(),
                                                                             model.parameters()))
        state = hook.local_state_dict()
        assert "all_gather" not in state and "reduce_scatter" in state, list(state)
        hook.load_state_dict(hook.state_dict())
        return {"losses": losses, "ratio": ag["ratio"]}
    before = [p.to_local().clone() for p in model.parameters()]
    x, y = batch(rank, 0)
    loss_of(model, x, y).backward()
    after = [p.to_local() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the sharded parameters changed"
    for m, rec in recorders.items():
        calls = check_against_reference(m, rec, world, param_dtype,
                                        roundtrip=int4_roundtrip if int4 else int8_roundtrip)
        forward = [c for c in calls if not c[1]]
        backward = [c for c in rec.calls if c[1]]
        assert len(forward) == 1, [c[:2] for c in rec.calls]
        if case == "reshard_false" or m is model:
            continue  # FSDP keeps the root's and (reshard False) every module's weights for backward
        assert len(backward) == 1, [c[:2] for c in rec.calls]
        size, _, _, out = backward[0]
        if case == "reshard_int":
            # Over the post-forward group of 2, which holds halves of each parameter's padded forward
            # output: the forward's decoded weights, gathered exactly.
            assert size == 2, size
            per_row = [padded_numel(p, world) for p in m.parameters()]
            ref = flats(forward[0][3], world, per_row)
            got = flats(out, 2, [n * world // 2 for n in per_row])
            assert all(torch.equal(a, b) for a, b in zip(ref, got)), "backward weights differ from forward's"
        else:
            assert size == world and torch.equal(out, forward[0][3]), "backward weights differ from forward's"
    return case


def nan_is_refused(rank, world):
    model, _ = build(world, "fp32")
    gt.fsdp(model, params=gradcomp.Int8(block_size=BLOCK), reduce_scatter=False)
    if rank == 1:
        with torch.no_grad():
            model[2].weight.to_local().view(-1)[3] = float("nan")
    try:
        loss_of(model, *batch(rank, 0))
    except RuntimeError as e:
        message = str(e)
        assert "module '2'" in message and "rank(s) 1 hold NaN or infinity" in message, message
        return message
    raise AssertionError("a NaN weight was all-gathered")


def two_dtypes_are_fsdps_refusal(rank, world):
    """FSDP (2.15) refuses parameters of two dtypes in one module at its lazy init, before any all-gather:
    its uint8 all-gather of several dtypes comes only from fsdp_pre_all_gather extensions, which
    gradcomp.torch.fsdp(params=...) refuses. (The core's runs still take such rows.)"""
    model, _ = build(world, "two_dtypes")
    gt.fsdp(model, params=gradcomp.Int8(block_size=BLOCK), reduce_scatter=False)
    try:
        loss_of(model, *batch(rank, 0))
    except AssertionError as e:
        assert "uniform original parameter dtype" in str(e), str(e)
        return "refused by FSDP"
    raise AssertionError("FSDP took two dtypes in one module: test the uint8 path bit for bit here")


def cpp_api_matches_the_reference(rank, world):
    """The C++ API (gradcomp::WeightAllGather, bound as _C.WeightAllGather) on a program's own shards: an uneven
    bf16 shard whose last block is short, the input a row of the output as FSDP passes it."""
    gather = gradcomp._C.WeightAllGather(dist.group.WORLD, BLOCK)
    g = torch.Generator().manual_seed(7 + rank)
    mine = (torch.randn(77, generator=g) * 0.05).to(torch.bfloat16)
    out = torch.zeros(world * 77, dtype=torch.bfloat16)
    out[rank * 77:(rank + 1) * 77] = mine
    gather.all_gather(out, out[rank * 77:(rank + 1) * 77], "my_layer")
    every = torch.empty(world * 77, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(every, mine)
    expected = int8_all_gather(list(every.view(world, -1)), None, BLOCK)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    # The layout agreement (32 bytes), then the payload: header, 3 scales padded, 77 codes padded.
    assert gather.bytes_sent() == (world - 1) * (32 + 32 + 16 + 80)
    # Another name through the same object is its own bucket: shards of another size and dtype, whose
    # layout the ranks agree on at its first call (32 bytes more), then the first name's again.
    other = (torch.randn(40, generator=g) * 3.0).float()
    out2 = torch.zeros(world * 40)
    gather.all_gather(out2, other, "other_layer")
    every2 = torch.empty(world * 40)
    dist.all_gather_into_tensor(every2, other)
    assert torch.equal(out2.view(torch.uint8), int8_all_gather(list(every2.view(world, -1)), None, BLOCK).view(torch.uint8))
    out[:] = 0
    gather.all_gather(out, mine, "my_layer")
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    assert gather.bytes_sent() == (world - 1) * ((32 + 32 + 16 + 80) + (32 + 32 + 16 + 48) + (32 + 16 + 80))
    # Its errors name it and the caller's tensor, not FSDP: its own checks, and the core's.
    try:
        gather.all_gather(torch.zeros(world * 40 + 1), other, "other_layer")
    except RuntimeError as e:
        assert "WeightAllGather output of other_layer has" in str(e) and "FSDP" not in str(e), str(e)
    else:
        raise AssertionError("an output of the wrong size was taken")
    uneven = torch.ones(5 + rank)
    try:
        gather.all_gather(torch.zeros(world * (5 + rank)), uneven, "uneven_layer")
    except RuntimeError as e:
        assert str(e).startswith("gradcomp: WeightAllGather: ") and "all-gather of uneven_layer" in str(e), str(e)
        assert "layouts differ" in str(e), str(e)
        assert "FSDP" not in str(e), str(e)
    else:
        raise AssertionError("shards of different sizes under one name were all-gathered")
    return "cpp"


def cpp_api_on_cuda_matches_the_reference(rank, world):
    """gradcomp::WeightAllGather on CUDA tensors (the ranks share one GPU over Gloo): under v1 its first call
    is refused naming GRADCOMP_KERNELS=v2; under v2 the rows equal the reference's of every rank's shard
    (the input a row of the output), bytes as on the CPU, and a NaN shard is refused by name on every rank
    with no row written."""
    import os

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(7 + rank)
    mine = (torch.randn(77, generator=g) * 0.05).to(torch.bfloat16)
    every = torch.empty(world * 77, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(every, mine)
    expected = int8_all_gather(list(every.view(world, -1)), None, BLOCK)
    gather = gradcomp._C.WeightAllGather(dist.group.WORLD, BLOCK)
    out = torch.zeros(world * 77, dtype=torch.bfloat16, device=dev)
    out[rank * 77:(rank + 1) * 77] = mine.to(dev)
    if os.environ.get("GRADCOMP_KERNELS") != "v2":
        try:
            gather.all_gather(out, out[rank * 77:(rank + 1) * 77], "my_layer")
        except RuntimeError as e:
            assert "GRADCOMP_KERNELS=v2" in str(e), str(e)
            return "refused"
        raise AssertionError("the v1 kernels' CUDA int8 all-gather was not refused")
    gather.all_gather(out, out[rank * 77:(rank + 1) * 77], "my_layer")
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert gather.bytes_sent() == (world - 1) * (32 + 32 + 16 + 80)
    poisoned = mine.to(dev)
    if rank == world - 1:
        poisoned[5] = float("nan")
    marker = torch.full((world * 77,), 3.0, dtype=torch.bfloat16, device=dev)
    try:
        gather.all_gather(marker, poisoned, "my_layer")
    except RuntimeError as e:
        assert "my_layer" in str(e) and f"rank(s) {world - 1} hold NaN or infinity" in str(e), str(e)
        assert bool((marker == 3.0).all()), "a refused all-gather wrote rows"
        return "cuda"
    raise AssertionError("a NaN shard was all-gathered on CUDA")


def int4_on_cuda_matches_the_reference(rank, world):
    """The front end's collective (_C.FsdpAllGather, what gradcomp.torch.fsdp(params=gradcomp.Int4()) calls)
    with the 4-bit codec on CUDA tensors (ranks sharing one GPU over Gloo): under v1 refused naming
    GRADCOMP_KERNELS=v2; under v2 rows of two runs (fp32 then bf16 at an odd row offset) equal the reference
    (int4_roundtrip per run) of every rank's row, the input a row of the output."""
    import os

    from gradcomp import _C

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    runs = [(torch.float32, 45), (torch.bfloat16, 70)]
    g = torch.Generator().manual_seed(11 + rank)
    mine = torch.cat([(torch.randn(45, generator=g) * 0.05).view(torch.uint8),
                      (torch.randn(70, generator=g) * 0.05).to(torch.bfloat16).view(torch.uint8)])
    row = mine.numel()
    every = torch.empty(world * row, dtype=torch.uint8)
    dist.all_gather_into_tensor(every, mine)
    expected = int8_all_gather(list(every.view(world, -1)), runs, BLOCK, roundtrip=int4_roundtrip)
    gather = _C.FsdpAllGather(dist.group.WORLD, {"codec": "int4", "block_size": BLOCK})
    out = torch.zeros(world * row, dtype=torch.uint8, device=dev)
    out[rank * row:(rank + 1) * row] = mine.to(dev)
    names = [("float32", 45), ("bfloat16", 70)]
    try:
        gather.all_gather(out, out[rank * row:(rank + 1) * row], names, 0, "my_layer", False)
    except RuntimeError as e:
        assert os.environ.get("GRADCOMP_KERNELS") != "v2", str(e)
        assert "GRADCOMP_KERNELS=v2" in str(e), str(e)
        return "int4 refused"
    assert os.environ.get("GRADCOMP_KERNELS") == "v2", "the v1 kernels' CUDA 4-bit all-gather was not refused"
    torch.cuda.current_stream().synchronize()
    assert torch.equal(out.cpu(), expected.view(torch.uint8)), "4-bit rows on CUDA differ from the reference"
    return "int4 cuda"


def weight_metrics_move_with_the_wire(rank, world):
    """The all-gathers' Prometheus series (gradcomp_weight_*) are stats()["all_gather"] and move by the
    bytes this rank's sockets sent in a forward that runs all-gathers alone; the gradient series
    (gradcomp_*, stats()["total"]) do not move then, and count the reduce-scatter alone."""
    from prometheus_client.parser import text_string_to_metric_families
    from workers_wire import settled_tcp_bytes_sent

    model, _ = build(world, "fp32")
    hook = gt.fsdp(model, gradcomp.Q4(seed=3), params=gradcomp.Int8(block_size=BLOCK))

    def values():
        return {s.name: s.value for f in text_string_to_metric_families(hook.metrics_text()) for s in f.samples
                if not s.name.startswith("gradcomp_bucket_seconds")}

    start = values()
    assert start["gradcomp_weight_sent_bytes_total"] == 0 and start["gradcomp_weight_compression_ratio"] == 0, start
    loss_of(model, *batch(rank, 0)).backward()  # the first step also agrees on each module's layout
    wire_before, before = settled_tcp_bytes_sent(), values()
    with torch.no_grad():
        loss_of(model, *batch(rank, 1))  # forward only: all-gathers, no reduce-scatter
    wire, after = settled_tcp_bytes_sent() - wire_before, values()
    moved = after["gradcomp_weight_sent_bytes_total"] - before["gradcomp_weight_sent_bytes_total"]
    assert moved > 0 and moved <= wire <= moved * 1.04 + 1024, (moved, wire)
    assert after["gradcomp_weight_all_gathers_total"] > before["gradcomp_weight_all_gathers_total"], after
    assert after["gradcomp_sent_bytes_total"] == before["gradcomp_sent_bytes_total"], (before, after)
    assert after["gradcomp_buckets_total"] == before["gradcomp_buckets_total"], (before, after)
    loss_of(model, *batch(rank, 2)).backward()
    stats, end = hook.stats(), values()
    weights, gradients = stats["all_gather"]["total"], stats["total"]
    assert gradients["bytes_sent"] == stats["reduce_scatter"]["total"]["bytes_sent"] > 0, stats
    assert end["gradcomp_sent_bytes_total"] == gradients["bytes_sent"], (end, gradients)
    assert end["gradcomp_uncompressed_bytes_total"] == gradients["uncompressed_bytes"], (end, gradients)
    assert end["gradcomp_weight_sent_bytes_total"] == weights["bytes_sent"], (end, weights)
    assert end["gradcomp_weight_uncompressed_bytes_total"] == weights["uncompressed_bytes"], (end, weights)
    assert end["gradcomp_weight_all_gathers_total"] == weights["buckets"], (end, weights)
    assert abs(end["gradcomp_weight_compression_ratio"] - weights["ratio"]) < 1e-9 * weights["ratio"], end
    # The text writes the shortest digits that read back as the same double: equal, not near.
    assert end["gradcomp_weight_codec_seconds_total"] == weights["codec_seconds"], (end, weights)
    assert 3.0 < weights["ratio"] < 4.0, weights  # fp32 weights: 32 bits against 8 plus a scale per block
    return "metrics"


def hsdp_all_gathers_are_the_reference(rank, world, int4=False):
    """HSDP: fully_shard over a 2 x 2 DeviceMesh (replicas x shards) with int8 (or, int4: 4-bit) weights
    and the q4 reduce-scatter. Every all-gather, forward and backward, runs over the shard group of 2 and is
    the reference of that group's exact shards; the replicas of a shard decode the same bytes; and the
    reduce-scatter's group size the hook knows is the shard group's, not the mesh's 4 (a checkpoint of it
    loads into a fresh hook)."""
    assert world == 4
    mesh = hsdp_mesh()
    shard_group, replica_group = mesh["shard"].get_group(), mesh["replicate"].get_group()
    params, roundtrip = (gradcomp.Int4, int4_roundtrip) if int4 else (gradcomp.Int8, int8_roundtrip)

    def job():
        model = shard(make_model(), mesh=mesh)
        hook = gt.fsdp(model, gradcomp.Q4(seed=3), params=params(block_size=BLOCK))
        return model, hook

    model, hook = job()
    recorders = install_recorders(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, *batch(rank, step)).backward()
        for m, rec in recorders.items():
            calls = check_against_reference(m, rec, 2, None, group=shard_group, roundtrip=roundtrip)
            assert len(calls) == len(rec.calls), [c[0] for c in rec.calls]  # no all-gather over all 4
            assert any(c[1] for c in calls) or m is model, "no backward all-gather"
            for _, _, _, out in calls:  # the other replica of this shard decoded the same bytes
                other = torch.empty(2 * out.numel(), dtype=out.dtype)
                dist.all_gather_into_tensor(other, out, group=replica_group)
                assert torch.equal(other.view(2, -1)[0], other.view(2, -1)[1]), "replicas decoded differently"
            rec.calls.clear()
        opt.step()
    with torch.no_grad():
        mine = full(model).detach().clone()
    replicas = torch.empty(2 * mine.numel())
    dist.all_gather_into_tensor(replicas, mine, group=replica_group)
    assert torch.equal(replicas.view(2, -1)[0], replicas.view(2, -1)[1]), "the replicas' parameters diverged"
    state = hook.local_state_dict()
    assert state["reduce_scatter"]["world_size"] == 2, state["reduce_scatter"]["world_size"]
    assert state["reduce_scatter"]["residuals"], "no residuals to check the group size against"
    _, fresh = job()
    fresh.load_local_state_dict(state)  # refused when the hook takes the mesh's 4 ranks for the group
    return "int4_hsdp" if int4 else "hsdp"


def resumes_with_quantized_weights_through_distributed_checkpoint(rank, world, path):
    """torch.distributed.checkpoint with int8 and with 4-bit weight all-gathers (one checkpoint each): the
    saved model and optimizer are the exact sharded parameters (never the quantized weights), a load
    restores them bit for bit, and a job resumed from the checkpoint goes on bit for bit as the
    uninterrupted one."""
    for params in (gradcomp.Int8, gradcomp.Int4):
        at = f"{path}/{params.__name__}"

        def job(steps, **kwargs):
            make_hook = lambda model: gt.fsdp(model, gradcomp.Q4(seed=3), params=params(block_size=BLOCK))
            return dcp_job(rank, at, make_hook, steps, **kwargs)

        straight, _ = job(range(4))
        saved, saved_hook = job(range(2), save=True)
        assert all(torch.equal(v.to_local(), p.to_local()) for v, p in zip(saved.state_dict().values(),
                                                                             saved.parameters()))
        assert "all_gather" not in saved_hook.local_state_dict(), "the hook saved all-gather state"
        loaded, _ = job([], load=True)
        a, b = full(saved), full(loaded)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{at}: the round trip changed the weights"
        resumed, hook = job(range(2, 4), load=True)
        a, b = full(straight), full(resumed)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{at}: resume differs by {(a - b).abs().max()}"
        assert hook.local_state_dict()["reduce_scatter"]["step"] == 4
        assert hook.stats()["all_gather"]["total"]["bytes_sent"] > 0, f"{at}: the all-gather did not run"
    return True


def int8_all_gather_cases(rank, world, cases):
    """One launch, several cases in turn (each on a fresh model); "nan" must come last."""
    out = []
    for case in cases:
        run = {"nan": nan_is_refused, "two_dtypes": two_dtypes_are_fsdps_refusal,
               "cpp_api": cpp_api_matches_the_reference, "metrics": weight_metrics_move_with_the_wire,
               "cpp_api_cuda": cpp_api_on_cuda_matches_the_reference,
               "int4_cuda": int4_on_cuda_matches_the_reference,
               "hsdp": hsdp_all_gathers_are_the_reference,
               "int4_hsdp": lambda rank, world: hsdp_all_gathers_are_the_reference(rank, world, int4=True)}.get(case)
        out.append(run(rank, world) if run else run_case(rank, world, case))
        dist.barrier()
    return out

"""Per-rank bodies of the int8 parameter all-gather tests: ``fully_shard`` on Gloo/CPU ranks with
``gradcomp.torch.fsdp(..., params=gradcomp.Int8())``, every all-gather recorded and checked bit for bit
against the pure-PyTorch reference (reference.int8_all_gather) of every rank's exact shard."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

import gradcomp
import gradcomp.torch as gt
from gradcomp._torch_compat import fsdp_in_backward, fsdp_param_group
from reference import int8_all_gather
from workers_fsdp import batch, loss_of, make_model, rows

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


def check_against_reference(module, recorder, world, param_dtype):
    """Every shard-group all-gather of the module: its output is the reference of every rank's exact input
    row, and those rows are the module's exact sharded parameters (in the parameter dtype)."""
    params = list(module.parameters(recurse=False)) or [p for p in module.parameters()]
    full = [p.full_tensor().detach() for p in params]
    dtypes = [param_dtype or f.dtype for f in full]
    mixed = len(set(dtypes)) > 1
    runs = [(d, padded_numel(f, world)) for d, f in zip(dtypes, full)] if mixed else None
    shard_calls = [c for c in recorder.calls if c[0] == world]
    assert shard_calls, "no all-gather over the shard group"
    for _, _, inp, out in shard_calls:
        gathered = torch.empty(world * inp.numel(), dtype=inp.dtype)
        dist.all_gather_into_tensor(gathered, inp)
        per_rank = list(gathered.view(world, -1))
        if not mixed:
            exact = rows([f.to(dtypes[0]) for f in full], world)
            assert torch.equal(torch.stack(per_rank), exact), "the all-gather input is not the exact shard"
        expected = int8_all_gather(per_rank, runs, BLOCK)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), "output differs from the reference"
        assert not torch.equal(out.view(torch.uint8), gathered.view(torch.uint8)), "nothing was quantized"
    return shard_calls


def build(world, case):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case == "bf16" else None
    reshard = {"reshard_false": False, "reshard_int": 2}.get(case, True)
    model = nn.Sequential(TwoDtypes(), nn.ReLU(), nn.Linear(33, 5)) if case == "two_dtypes" else make_model()
    for layer in model:
        if isinstance(layer, (nn.Linear, TwoDtypes)):
            fully_shard(layer, reshard_after_forward=reshard, **({"mp_policy": mp} if mp else {}))
    fully_shard(model, reshard_after_forward=reshard, **({"mp_policy": mp} if mp else {}))
    return model, (torch.bfloat16 if mp else None)


def run_case(rank, world, case):
    model, param_dtype = build(world, case)
    codec = gradcomp.Q4(seed=3) if case == "train" else None
    hook = gt.fsdp(model, codec, params=gradcomp.Int8(block_size=BLOCK), reduce_scatter=case == "train")
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
        calls = check_against_reference(m, rec, world, param_dtype)
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
    """The C++ API (gradcomp::Int8AllGather, bound as _C.Int8AllGather) on a program's own shards: an uneven
    bf16 shard whose last block is short, the input a row of the output as FSDP passes it."""
    gather = gradcomp._C.Int8AllGather(dist.group.WORLD, BLOCK)
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
    return "cpp"


def int8_all_gather_cases(rank, world, cases):
    """One launch, several cases in turn (each on a fresh model); "nan" must come last."""
    out = []
    for case in cases:
        run = {"nan": nan_is_refused, "two_dtypes": two_dtypes_are_fsdps_refusal,
               "cpp_api": cpp_api_matches_the_reference}.get(case)
        out.append(run(rank, world) if run else run_case(rank, world, case))
        dist.barrier()
    return out

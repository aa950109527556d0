"""FSDP2 integration: gradcomp's compressed collectives as ``fully_shard``'s gradient communication.

``hook = gradcomp.torch.fsdp(model, gradcomp.Q4())`` installs, on every ``fully_shard`` module of the
model, a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that sends each row of FSDP's
reduce-scatter input as a q4 (or top-k) payload and decodes one's own shard in fp32, with an
error-feedback residual per module. With ``params=gradcomp.Int8()`` it also installs a custom all-gather
(``FSDPModule.set_custom_all_gather``) that sends each rank's parameter shard as block-scaled int8 and
decodes every rank's row, its own included, into FSDP's all-gather output. With ``replicate_group=``
(HSDP: shards inside a node, replicas across nodes) it installs instead an all-reduce hook
(``set_all_reduce_hook``) that averages each shard across the replicas through the compressed allreduce,
and leaves the reduce-scatter inside the node to FSDP. The work is the core's (``CompressedReduceScatter``,
``CompressedAllreduce``, ``CompressedAllGather``); this module only adapts FSDP's interfaces to it.
"""
from __future__ import annotations

import functools
import io
import os

import torch
import torch.distributed as dist

from . import _C
from ._torch_compat import (fsdp_all_gather_api, fsdp_in_backward, fsdp_param_group, fsdp_reduce_scatter_api,
                            premul_factor)
from .codecs import Int4, Int8, NoCompression, Q4, TopK, refuse_q2
from .ddp import check_optimizer

__all__ = ["fsdp", "FsdpHook"]

_STAT_KEYS = ("buckets", "compressed_buckets", "bytes_sent", "inter_node_bytes", "uncompressed_bytes",
              "codec_seconds", "comm_seconds", "nonfinite_buckets", "overlapped_buckets", "max_queued")


def _sum_stats(parts) -> dict:
    out = {k: 0 for k in _STAT_KEYS}
    for p in parts:
        for k in _STAT_KEYS:
            out[k] = max(out[k], p[k]) if k == "max_queued" else out[k] + p[k]
    out["ratio"] = out["uncompressed_bytes"] / out["bytes_sent"] if out["bytes_sent"] else 0.0
    return out


def _divisor(op, world: int) -> float:
    """What the decoded sum is divided by for FSDP's reduce op: AVG, SUM or PREMUL_SUM(factor)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return float(world)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = premul_factor(op)
        if not factor > 0:
            raise ValueError(f"gradcomp's FSDP reduce-scatter needs a positive PREMUL_SUM factor, got {factor}")
        return 1.0 / factor
    raise ValueError(f"gradcomp's FSDP reduce-scatter takes ReduceOp AVG, SUM or PREMUL_SUM, got {op!r}")


class FsdpHook:
    """gradcomp's collectives on a model's ``fully_shard`` modules: stats and checkpoint state.

    Module ``i`` (in ``model.modules()`` order) keeps its residuals under bucket ``i``. Each rank has its
    own residuals: ``state_dict()`` holds this rank's under the key ``"rank<r>"`` (so that
    ``torch.distributed.checkpoint`` keeps every rank's), ``local_state_dict()`` the same as plain dicts.
    """

    def __init__(self, codec, timeout=None):
        codec = Q4() if codec is None else codec
        refuse_q2(codec, "gradcomp.torch.fsdp")
        if isinstance(codec, NoCompression) or not isinstance(codec, (Q4, TopK)):
            raise ValueError(f"gradcomp.torch.fsdp takes gradcomp.Q4 or gradcomp.TopK, got {codec!r} (without "
                             f"compression, FSDP's own reduce-scatter is the one to use)")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.codec = codec
        self._options = {**codec._options(), "timeout": timeout}
        self._collectives = {}  # "reduce_scatter" / "replicate" / "all_gather": the native collective
        self._groups = {}
        self._pending = {}
        self._sizes = {}  # the group size of each collective installed, known at install time
        self._param_options = None  # the weight all-gather's options (fsdp(params=...)), or None
        self.modules = []

    def _collective(self, kind: str, group):
        collective = self._collectives.get(kind)
        if collective is None:
            if kind == "all_gather":
                collective = self._collectives[kind] = _C.FsdpAllGather(group, self._param_options)
            else:
                make = _C.FsdpReduceScatter if kind == "reduce_scatter" else _C.FsdpReplicaAllreduce
                collective = self._collectives[kind] = make(group, self._options)
            self._groups[kind] = group
            if kind in self._pending:
                collective.load_state_dict(self._pending.pop(kind))
        elif group is not self._groups[kind]:
            raise RuntimeError("gradcomp.torch.fsdp: the model's fully_shard modules reduce over different process "
                               "groups; call gradcomp.torch.fsdp once per group of modules")
        return collective

    def _reduce_scatter(self, output, input, group, op, bucket: int) -> None:
        self._collective("reduce_scatter", group).reduce_scatter(output, input, bucket, _divisor(op, group.size()))

    def _all_gather(self, output, input, group, runs, bucket: int, name: str, backward: bool) -> None:
        self._collective("all_gather", group).all_gather(output, input, runs, bucket, name, backward)

    def _replica_allreduce(self, group, bucket: int, tensor) -> None:
        self._collective("replicate", group).allreduce(tensor, bucket)

    def flush(self) -> None:
        """Waits for the verdicts the device has not reported yet and raises a rejected payload's error
        (naming the module's bucket and the sending rank). With ``GRADCOMP_KERNELS=v2`` on CUDA a q4 (or top-k)
        reduce-scatter returns before the device has checked what it received: a rejection or a non-finite
        result is reported by a later call, so the last ones of a run only by this. Call it before you
        trust the last step's gradients (after the last backward, before ``optimizer.step()``) and before
        saving; ``state_dict()`` calls it (``stats()`` does not: it never waits). On the CPU, and elsewhere on CUDA, every call
        reports its own verdict and this does nothing. Safe to call again."""
        for collective in self._collectives.values():
            collective.flush()

    def stats(self) -> dict:
        """``{"step": ..., "total": ...}``: the gradients' collectives (reduce-scatter and replica
        all-reduce): buckets (one per module and collective per step), bytes sent (a module's first step
        also carries its layout agreement), the bytes the uncompressed collective of the same dtype would
        send, their ratio, codec and communication seconds, non-finite buckets; and the same per
        collective under ``"reduce_scatter"`` / ``"replicate"`` / ``"all_gather"``. The int8 weights'
        all-gather (``params=``) counts only under ``"all_gather"`` (its uncompressed bytes are those of
        FSDP's own all-gather in the parameters' dtype), as its Prometheus series are gradcomp_weight_*
        beside the gradients' gradcomp_*: the wire carries the sum of both. Zero until a collective ran
        (FSDP calls none at one rank). Never waits for the device: on CUDA under v2 a call's non-finite or
        rejected buckets are counted when their verdict arrives (the module's next call, or ``flush()``), so
        a training loop may log this every step without a host wait."""
        per = {k: {"step": c.last_step_stats(), "total": c.total_stats()} for k, c in self._collectives.items()}
        gradients = [p for k, p in per.items() if k != "all_gather"]
        return {"step": _sum_stats([p["step"] for p in gradients]),
                "total": _sum_stats([p["total"] for p in gradients]), **per}

    def metrics_text(self) -> str:
        """This rank's counters in Prometheus's text format (front_end="fsdp"; gradcomp.torch.metrics
        serves them): the gradients' collectives as gradcomp_* (``stats()["total"]``), and with
        ``params=`` the weights' all-gathers as gradcomp_weight_* (``stats()["all_gather"]["total"]``).
        Reads counters only: a scrape never waits for a collective in flight."""
        codec = "q4" if isinstance(self.codec, Q4) else "topk"
        return _C.fsdp_metrics_text(list(self._collectives.values()), _rank(), codec,
                                    self._param_options is not None)

    def local_state_dict(self) -> dict:
        """This rank's state as plain dicts: per collective, its residuals (uint8 tensors by bucket),
        step, seed and group size. Calls ``flush()`` first: a state is saved only after the device accepted
        every call before it."""
        self.flush()
        out = {"format": 1, "kind": "gradcomp_fsdp"}
        for kind in ("reduce_scatter", "replicate"):
            if kind in self._collectives:
                out[kind] = self._collectives[kind].state_dict()
            elif kind in self._pending:
                out[kind] = self._pending[kind]
        return out

    def load_local_state_dict(self, state: dict, reset_residuals: bool = False) -> None:
        """Restores ``local_state_dict()``; before the first backward of the resumed run. A state saved by
        another world size is refused (residuals are laid out per rank) unless ``reset_residuals``, which
        keeps the step and drops the residuals."""
        if not isinstance(state, dict) or state.get("kind") != "gradcomp_fsdp" or state.get("format") != 1:
            raise ValueError("not a gradcomp.torch.fsdp state (local_state_dict format 1)")
        for kind in ("reduce_scatter", "replicate"):
            if kind not in state:
                continue
            part = state[kind]
            if reset_residuals:
                part = {**part, "residuals": {}, "chunk_residuals": {}}
            size = self._sizes.get(kind)
            if (part["residuals"] or part["chunk_residuals"]) and size is not None and part["world_size"] != size:
                raise ValueError(f"gradcomp.torch.fsdp: the {kind} state was saved by a group of "
                                 f"{part['world_size']} ranks and this group has {size}: each rank's residuals are "
                                 f"laid out for the group's size and cannot be regrouped (reset_residuals=True keeps "
                                 f"the step and drops them)")
            if kind in self._collectives:
                self._collectives[kind].load_state_dict(part)
            else:
                self._pending[kind] = part

    def state_dict(self) -> dict:
        """``{"rank<r>": bytes}``: this rank's ``local_state_dict()`` serialized, under a key of its own, so
        that ``torch.distributed.checkpoint`` (which keeps one copy of keys every rank has) saves every
        rank's residuals; also fine for a per-rank ``torch.save``."""
        buffer = io.BytesIO()
        torch.save(self.local_state_dict(), buffer)
        return {f"rank{_rank()}": buffer.getvalue()}

    def load_state_dict(self, state: dict, reset_residuals: bool = False) -> None:
        key = f"rank{_rank()}"
        if not isinstance(state, dict) or key not in state:
            have = sorted(k for k in state if isinstance(k, str) and k.startswith("rank")) if isinstance(state, dict) \
                else []
            raise ValueError(f"gradcomp.torch.fsdp state has no entry for this rank ({key}); it holds {have}: "
                             f"saved by another world size? (load_local_state_dict(..., reset_residuals=True) "
                             f"of any rank's entry keeps the step and drops the residuals)")
        value = state[key]
        # weights_only: the state is dicts of tensors, ints and strings, and a checkpoint is data, never code.
        local = torch.load(io.BytesIO(value), weights_only=True) if isinstance(value, (bytes, bytearray)) \
            else value
        self.load_local_state_dict(local, reset_residuals)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _comm_class():
    FSDPModule, ReduceScatter = fsdp_reduce_scatter_api()

    class GradcompReduceScatter(ReduceScatter):
        """One ``fully_shard`` module's reduce-scatter: FSDP allocates through it and calls it."""

        def __init__(self, hook: FsdpHook, bucket: int):
            self._hook = hook
            self._bucket = bucket

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self._hook._reduce_scatter(output_tensor, input_tensor, group, op, self._bucket)
            return None

    return FSDPModule, GradcompReduceScatter


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _runs_of(param_group, input_tensor, name: str):
    """The all-gather row's layout as (dtype, elements) runs: the input's own dtype when FSDP gathers one
    dtype; for FSDP's uint8 bytes of several dtypes, each parameter's padded shard in its all-gather dtype
    (the parameter policy's ``param_dtype``, else its own), consecutive ones of one dtype merged."""
    if input_tensor.dtype != torch.uint8:
        if input_tensor.dtype not in _DTYPE_NAMES:
            raise RuntimeError(f"gradcomp.torch.fsdp(params=...): the all-gather of {name} is in "
                               f"{input_tensor.dtype}; the quantized weight all-gather (Int8, Int4) takes float32, bfloat16 or float16")
        return [(_DTYPE_NAMES[input_tensor.dtype], input_tensor.numel())]
    runs = []
    for fp in param_group.fsdp_params:
        data = fp._sharded_param_data
        dtype = fp.param_dtype or data.dtype
        if dtype not in _DTYPE_NAMES:
            raise RuntimeError(f"gradcomp.torch.fsdp(params=...): a parameter of {name} is all-gathered in {dtype}; "
                               f"the quantized weight all-gather (Int8, Int4) takes float32, bfloat16 or float16")
        if runs and runs[-1][0] == _DTYPE_NAMES[dtype]:
            runs[-1] = (runs[-1][0], runs[-1][1] + data.numel())
        else:
            runs.append((_DTYPE_NAMES[dtype], data.numel()))
    return runs


def _all_gather_class():
    AllGather = fsdp_all_gather_api()

    class GradcompAllGather(AllGather):
        """One ``fully_shard`` module's parameter all-gather as int8. Over the module's shard group only:
        FSDP's other all-gather, before backward under ``reshard_after_forward=<int>``, gathers shards of the
        weights this one already decoded over the smaller post-forward group, and goes through unchanged so
        that backward computes with exactly the forward's weights."""

        def __init__(self, hook: FsdpHook, bucket: int, name: str, param_group):
            self._hook = hook
            self._bucket = bucket
            self._name = name
            self._param_group = param_group
            self._shard_group = param_group.mesh_info.shard_process_group

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if group is not self._shard_group:
                dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
                return None
            runs = _runs_of(self._param_group, input_tensor, self._name)
            self._hook._all_gather(output_tensor, input_tensor, group, runs, self._bucket, self._name,
                                   fsdp_in_backward(self._param_group))
            return None

    return GradcompAllGather


def _check_plain_parameters(modules, names, int4=False) -> None:
    codec = "gradcomp.Int4()" if int4 else "gradcomp.Int8()"
    for m in modules:
        for p in m.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            # meta: materialized later, checked at the call; CUDA: the v2 kernels only (the core refuses
            # v1 by name too, at the first all-gather)
            if local.device.type == "cuda" and os.environ.get("GRADCOMP_KERNELS", "v1") != "v2":
                raise ValueError(f"gradcomp.torch.fsdp(params={codec}): {names[m]} has parameters on "
                                 f"{local.device}; the weight all-gather's CUDA kernels are v2 only: set "
                                 f"GRADCOMP_KERNELS=v2 (opt-in until a GPU has run them byte-equal to the CPU), "
                                 f"or leave params unset there")
            if local.device.type not in ("cpu", "meta", "cuda"):
                raise ValueError(f"gradcomp.torch.fsdp(params=...): {names[m]} has parameters on {local.device}; "
                                 f"the weight all-gather runs on the CPU, or on CUDA with GRADCOMP_KERNELS=v2")
            if hasattr(local, "fsdp_pre_all_gather"):
                raise ValueError(f"gradcomp.torch.fsdp(params=...): {names[m]} has a parameter of type "
                                 f"{type(local).__name__} with its own fsdp_pre_all_gather (float8 training?); its "
                                 f"all-gather inputs are not plain weights and are not quantized again")


def _check_shard_only(modules) -> None:
    for m in modules:
        for p in m.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.ndim != 1:
                raise ValueError("gradcomp.torch.fsdp(replicate_group=...) needs fully_shard over the shard "
                                 "dimension only (mesh=mesh['shard']): with a 2-D mesh FSDP all-reduces across "
                                 "replicas itself, uncompressed, before any hook runs")


@torch.no_grad()
def _broadcast_replicas(model, group) -> None:
    """Makes every replica start from replica 0's parameters (FSDP over a shard group alone does not)."""
    src = dist.get_global_rank(group, 0)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        dist.broadcast(local, src=src, group=group)


def fsdp(model: torch.nn.Module, codec=None, *, params=None, replicate_group=None, reduce_scatter=None,
         timeout=None, optimizer=None) -> FsdpHook:
    """Installs gradcomp's compressed collectives on every ``fully_shard`` module of ``model`` (the model
    itself included); returns the hook holding their state. Call after ``fully_shard``, before the first
    backward.

    Without ``replicate_group``: FSDP's reduce-scatter is compressed. With it (HSDP as ``fully_shard`` over
    ``mesh["shard"]`` plus ``replicate_group=mesh["replicate"].get_group()``): each module's reduced shard is
    averaged across replicas by the compressed allreduce (parameters are broadcast from the first replica
    here), and the reduce-scatter inside the shard group stays FSDP's unless ``reduce_scatter=True``.
    ``optimizer``, when given, is checked against the codec as ``register``'s is (``check_optimizer``).

    ``params=gradcomp.Int8()``: FSDP's parameter all-gathers over each module's shard group send int8 (every
    rank decodes every shard, its own included, so all ranks compute with the same weights; the sharded
    parameters the optimizer updates stay exact). ``reduce_scatter=False`` with it compresses only the
    weights. On CPU, or on CUDA with ``GRADCOMP_KERNELS=v2`` (its kernels are v2 only and opt-in until a GPU
    has run them byte-equal to the CPU). ``params=gradcomp.Int4()``: the same with 4-bit codes (blocks of 32 by
    default), on the CPU or on CUDA with ``GRADCOMP_KERNELS=v2`` likewise."""
    FSDPModule, comm_class = _comm_class()
    if params is not None and not isinstance(params, (Int8, Int4)):
        raise ValueError(f"gradcomp.torch.fsdp params takes gradcomp.Int8() or gradcomp.Int4(), got {params!r}")
    all_gather_class = _all_gather_class() if params is not None else None
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("gradcomp.torch.fsdp: the model has no fully_shard module; call fully_shard first")
    if reduce_scatter is None:
        reduce_scatter = replicate_group is None
    hook = FsdpHook(codec, timeout)
    hook._param_options = {**params._options(), "timeout": timeout} if params is not None else None
    names = {m: (f"module '{n}'" if n else "the root module") for n, m in model.named_modules()}
    param_groups = {}
    if params is not None:
        _check_plain_parameters(modules, names, isinstance(params, Int4))
        param_groups = {m: fsdp_param_group(m) for m in modules}
    if optimizer is not None:
        check_optimizer(optimizer, hook.codec)
    if reduce_scatter:
        meshes = {getattr(p, "device_mesh", None) for m in modules for p in m.parameters()} - {None}
        if len(meshes) == 1:  # FSDP reduce-scatters over the mesh's last dimension (HSDP: the shard one)
            mesh = next(iter(meshes))
            hook._sizes["reduce_scatter"] = mesh.size(mesh.ndim - 1)
    if replicate_group is not None:
        hook._sizes["replicate"] = replicate_group.size()
        _check_shard_only(modules)
        if replicate_group.size() > 1:
            _broadcast_replicas(model, replicate_group)
    for bucket, module in enumerate(modules):
        if reduce_scatter:
            module.set_custom_reduce_scatter(comm_class(hook, bucket))
        if replicate_group is not None:
            module.set_all_reduce_hook(functools.partial(hook._replica_allreduce, replicate_group, bucket))
        if params is not None and param_groups[module] is not None:
            module.set_custom_all_gather(all_gather_class(hook, bucket, names[module], param_groups[module]))
    hook.modules = modules
    return hook

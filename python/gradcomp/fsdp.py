"""FSDP2 integration: gradcomp's compressed reduce-scatter as ``fully_shard``'s gradient reduce-scatter.

``hook = gradcomp.torch.fsdp(model, gradcomp.Q4())`` installs, on every ``fully_shard`` module of the
model, a custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) that sends each row of FSDP's
reduce-scatter input as a q4 (or top-k) payload and decodes one's own shard in fp32, with an
error-feedback residual per module. The work is the core's ``CompressedReduceScatter``; this module
only adapts FSDP's ``ReduceScatter`` interface to it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C
from ._torch_compat import fsdp_reduce_scatter_api, premul_factor
from .codecs import NoCompression, Q4, TopK

__all__ = ["fsdp", "FsdpHook"]


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
    """The compressed reduce-scatter of a model's ``fully_shard`` modules: stats and checkpoint state.

    Module ``i`` (in ``model.modules()`` order) keeps its residual under bucket ``i``. ``state_dict()`` is
    this rank's (each rank saves its own, like the optimizer's sharded state).
    """

    def __init__(self, codec, timeout=None):
        codec = Q4() if codec is None else codec
        if isinstance(codec, NoCompression) or not isinstance(codec, (Q4, TopK)):
            raise ValueError(f"gradcomp.torch.fsdp takes gradcomp.Q4 or gradcomp.TopK, got {codec!r} (without "
                             f"compression, FSDP's own reduce-scatter is the one to use)")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.codec = codec
        self._options = {**codec._options(), "timeout": timeout}
        self._collective = None
        self._group = None
        self._pending = None
        self.modules = []

    def _for_group(self, group):
        if self._collective is None:
            self._collective = _C.FsdpReduceScatter(group, self._options)
            self._group = group
            if self._pending is not None:
                self._collective.load_state_dict(self._pending)
                self._pending = None
        elif group is not self._group:
            raise RuntimeError("gradcomp.torch.fsdp: the model's fully_shard modules reduce over different process "
                               "groups; call gradcomp.torch.fsdp once per group of modules")
        return self._collective

    def _reduce_scatter(self, output, input, group, op, bucket: int) -> None:
        collective = self._for_group(group)
        collective.reduce_scatter(output, input, bucket, _divisor(op, group.size()))

    def stats(self) -> dict:
        """Counters since the first reduce-scatter: buckets (one per module per step), bytes sent, the
        bytes an uncompressed reduce-scatter of the same dtype would send, codec and communication seconds,
        non-finite buckets."""
        return self._collective.total_stats() if self._collective is not None else {}

    def last_step_stats(self) -> dict:
        """The same counters for the step in progress, or the last one."""
        return self._collective.last_step_stats() if self._collective is not None else {}

    def state_dict(self) -> dict:
        """This rank's residuals (one per module), step and seed; restore with ``load_state_dict``
        before the first backward of the resumed run."""
        if self._collective is not None:
            return self._collective.state_dict()
        if self._pending is not None:
            return self._pending
        raise RuntimeError("gradcomp.torch.fsdp: state_dict before the first reduce-scatter holds nothing; save it "
                           "after a step")

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "fsdp_reduce_scatter":
            raise ValueError("not a gradcomp.torch.fsdp state_dict")
        if self._collective is not None:
            self._collective.load_state_dict(state)
        else:
            self._pending = state


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


def fsdp(model: torch.nn.Module, codec=None, *, timeout=None) -> FsdpHook:
    """Installs gradcomp's compressed reduce-scatter on every ``fully_shard`` module of ``model`` (the
    model itself included) and returns the hook holding its state. Call after ``fully_shard``."""
    FSDPModule, comm_class = _comm_class()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("gradcomp.torch.fsdp: the model has no fully_shard module; call fully_shard first")
    hook = FsdpHook(codec, timeout)
    for bucket, module in enumerate(modules):
        module.set_custom_reduce_scatter(comm_class(hook, bucket))
    hook.modules = modules
    return hook

"""DiLoCo: H local steps per rank, then the outer gradient in 4 bits through gradcomp's compressed allreduce.

``diloco = gradcomp.torch.diloco(model, optimizer, gradcomp.Q4(), inner_steps=100)`` leaves the model
unwrapped (no DDP: no gradient is synchronised between rounds) and hooks the optimizer's ``step``: after
every H-th inner step, each rank's outer gradient (its parameters at the round's start minus now) is
averaged through the compressed allreduce (two-phase q4, error feedback across rounds, hierarchical with
``local_world_size``), and an outer Nesterov SGD (lr 0.7, momentum 0.9, as the DiLoCo papers) moves the
parameters every rank then shares. The rounds are the core's (``gradcomp::OuterSync``); the C++ front
end is ``gradcomp::DiLoCo``; this module only adapts them to a model and an optimizer.
"""
from __future__ import annotations

import io
import warnings

import torch
import torch.distributed as dist

from . import _C
from .codecs import NoCompression, Q2, Q4, TopK
from .ddp import node_groups

__all__ = ["diloco", "DiLoCo"]

# The outer defaults (lr 0.7, Nesterov momentum 0.9) are the DiLoCo papers', tuned on runs of tens of thousands
# of steps; on the short runs measured (docs/api.md, "DiLoCo's outer settings on short runs") they cost several
# times the loss of outer lr 1.0, momentum 0.3. The rule and the numbers are the core's (gradcomp/outer_short_run.h),
# so the C++ front end warns alike.
SHORT_RUN_ROUNDS = _C.diloco_short_run_rounds
SHORT_RUN_MEASURED = _C.diloco_short_run_measurements


def _positive_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class DiLoCo:
    """The outer rounds of one model. ``step()`` after each inner optimizer step (done for you when an
    optimizer was given); ``stats()``; ``state_dict()`` / ``load_state_dict()`` (this rank's anchors, outer
    momentum, round counters, residuals and round in flight, under the key ``"rank<r>"`` so that
    ``torch.distributed.checkpoint`` keeps every rank's; save the model and the inner optimizer beside it)."""

    def __init__(self, params, optimizer=None, codec=None, *, inner_steps=100, outer_lr=0.7, outer_momentum=0.9,
                 nesterov=True, fragments=1, overlap_steps=0, mixing=0.0, eager=False, process_group=None,
                 local_world_size=None, timeout=None):
        codec = Q4() if codec is None else codec
        if isinstance(codec, NoCompression) or not isinstance(codec, (Q4, Q2, TopK)):
            raise ValueError(f"gradcomp DiLoCo sends outer gradients compressed: pass gradcomp.Q4, gradcomp.Q2 or "
                             f"gradcomp.TopK, "
                             f"got {codec!r}")
        _positive_int("inner_steps", inner_steps)
        _positive_int("fragments", fragments)
        _positive_int("overlap_steps", overlap_steps, low=0)
        if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0.0 <= mixing <= 1.0:
            raise ValueError(f"mixing (alpha) must be a number in [0, 1], got {mixing!r}")
        if not isinstance(eager, bool):
            raise ValueError(f"eager must be True or False, got {eager!r}")
        if eager and overlap_steps == 0:
            raise ValueError("gradcomp DiLoCo: eager updates (eager=True) need overlap_steps (tau) > 0: without "
                             "overlap the global update is there at once")
        if eager and mixing != 0.0:
            raise ValueError(f"gradcomp DiLoCo: eager updates take mixing (alpha) = 0, got {mixing!r}: the eager "
                             f"merge keeps the tau steps' local progress itself")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.params = list(params)
        if not self.params:
            raise ValueError("gradcomp DiLoCo: no parameters")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor) or type(p.data) is not torch.Tensor:
                raise ValueError(f"gradcomp DiLoCo: parameter {i} is a {type(p.data).__name__}, not a plain tensor "
                                 f"(a sharded or wrapped parameter: DiLoCo needs every rank's whole parameters)")
            if getattr(p, "_is_flat_param", False):
                raise ValueError(f"gradcomp DiLoCo: parameter {i} is FSDP's flat parameter (a shard): DiLoCo replaces "
                                 f"FSDP; pass the unwrapped model")
        self.codec = codec
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        intra, inter = node_groups(self.process_group, local_world_size)
        options = {**codec._options(), "inner_steps": inner_steps, "outer_lr": float(outer_lr),
                   "outer_momentum": float(outer_momentum), "nesterov": bool(nesterov), "fragments": fragments,
                   "overlap_steps": overlap_steps, "mixing": float(mixing), "eager": bool(eager),
                   "timeout": timeout, "intra_node": intra, "inter_node": inter}
        self._native = _C.DiLoCo([p.detach() for p in self.params], self.process_group, options)
        self._handle = optimizer.register_step_post_hook(lambda *_: self.step()) if optimizer is not None else None

    def step(self) -> int:
        """Counts one inner step and syncs the fragments due; returns how many synced."""
        return self._native.step()

    def flush(self) -> bool:
        """With ``overlap_steps`` > 0: waits for the round in flight and merges it now (call it after the
        last inner step, before evaluating or saving the final model). Returns whether there was one."""
        return self._native.flush()

    def fragments(self):
        """The parameter positions of each fragment (streaming DiLoCo), in order."""
        return self._native.fragments()

    def stats(self) -> dict:
        return self._native.stats()

    def metrics_text(self) -> str:
        """This rank's counters in Prometheus's text format (front_end="diloco"; a round counts as a
        bucket): ``gradcomp.torch.metrics.serve(port, diloco)`` serves them."""
        return self._native.metrics_text()

    def local_state_dict(self) -> dict:
        """This rank's state as named tensors (format, rounds, anchors, momenta, residuals, the round in flight
        and, with eager, this rank's eager step). With a round in flight it waits for its allreduce first."""
        return self._native.state_dict()

    def load_local_state_dict(self, state: dict) -> None:
        """Restores ``local_state_dict()`` (refused whole, naming what is wrong, when it does not fit)."""
        self._native.load_state_dict(state)

    def state_dict(self) -> dict:
        """``{"rank<r>": bytes}``: this rank's ``local_state_dict()`` serialized under a key of its own, so that
        ``torch.distributed.checkpoint`` (which keeps one copy of keys every rank has) saves every rank's
        residuals and round in flight; also fine for a per-rank ``torch.save``."""
        buffer = io.BytesIO()
        torch.save(self.local_state_dict(), buffer)
        return {f"rank{_rank()}": buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` (this rank's entry), or a state saved before states were keyed by rank (the
        named tensors themselves, as ``local_state_dict()`` gives them)."""
        if isinstance(state, dict) and "format" in state:
            self.load_local_state_dict(state)
            return
        key = f"rank{_rank()}"
        if not isinstance(state, dict) or key not in state:
            have = sorted(k for k in state if isinstance(k, str) and k.startswith("rank")) if isinstance(state, dict) \
                else []
            raise ValueError(f"gradcomp DiLoCo state has no entry for this rank ({key}); it holds {have}: saved by "
                             f"another world size? (each rank's residuals and round are its own)")
        value = state[key]
        # weights_only: the state is named tensors, and a checkpoint is data, never code.
        local = torch.load(io.BytesIO(value), weights_only=True) if isinstance(value, (bytes, bytearray)) else value
        self.load_local_state_dict(local)

    def remove(self) -> None:
        """Stops syncing on the optimizer's steps."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def diloco(model, optimizer=None, codec=None, **options) -> DiLoCo:
    """DiLoCo over ``model`` (a module, or its parameters) with ``optimizer`` as the inner optimizer.

    With the default outer settings it warns when the run may be short (fewer than 100 rounds, or
    ``planned_steps`` not given): see docs/api.md for the numbers.

    Every rank must call it (it broadcasts rank 0's parameters, so a resumed run loads its model,
    optimizer and DiLoCo checkpoints after it: mid-round each rank's parameters are its own). Options:
    ``inner_steps`` (H, 100), ``outer_lr`` (0.7), ``outer_momentum`` (0.9), ``nesterov`` (True), ``fragments``
    (1; streaming: the parameters in this many fragments whose rounds are staggered), ``overlap_steps``
    (tau, 0; > 0: a fragment's round runs in the background and merges tau inner steps after its sync point;
    tau * fragments < H; a CUDA model needs the v2 kernels: kernels="v2" or GRADCOMP_KERNELS=v2), ``mixing``
    (alpha, 0.0: at the merge the fragment becomes alpha * local + (1 - alpha) * global), ``eager`` (False;
    True, with overlap_steps > 0 and mixing 0: at the sync point each rank takes the outer step with its own
    outer gradient at once and trains on from there; at the merge the late global step replaces it,
    param += global - eager; docs/algorithms.md),
    ``process_group`` (with overlap_steps > 0, a group the program uses for nothing else meanwhile),
    ``local_world_size`` (ranks per node for the hierarchical allreduce; None, the default: the launcher's
    ranks per node when the job spans several nodes, as ``register``'s), ``timeout`` (seconds),
    ``planned_steps`` (None; the inner steps the run will take, for the short-run warning only). Only
    parameters are synced: buffers (BatchNorm's statistics) stay each rank's own.
    """
    _warn_if_short_run_defaults(options)
    if isinstance(model, torch.nn.Module):
        group = options.get("process_group")
        for m in model.modules():
            if isinstance(m, torch.nn.parallel.DistributedDataParallel) and (
                    group is None or m.process_group is group):
                raise ValueError("gradcomp DiLoCo replaces DDP over the same ranks: pass the unwrapped model (DDP "
                                 "would average every step); DDP inside a node with DiLoCo across nodes passes "
                                 "ddp.module and process_group=<the group across nodes>")
            if type(m).__name__ == "FullyShardedDataParallel":
                raise ValueError("gradcomp DiLoCo replaces FSDP: pass the unwrapped model")
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return DiLoCo(params, optimizer, codec, **options)


def _warn_if_short_run_defaults(options) -> None:
    """Pops ``planned_steps``; warns when the outer settings are the defaults and the run has (or may have) fewer
    than SHORT_RUN_ROUNDS rounds."""
    planned = options.pop("planned_steps", None)
    if planned is not None:
        _positive_int("planned_steps", planned)
    inner_steps = options.get("inner_steps", 100)
    _positive_int("inner_steps", inner_steps)
    # Passed settings count as chosen even when they equal the defaults (C++ can only compare values).
    kept = "outer_lr" not in options and "outer_momentum" not in options
    warning = _C.diloco_short_run_warning(kept, inner_steps, 0 if planned is None else planned)
    if warning:
        warnings.warn(warning, UserWarning, stacklevel=3)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

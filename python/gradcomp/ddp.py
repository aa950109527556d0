"""PyTorch DDP integration: gradcomp as a DistributedDataParallel communication hook.

Users reach it as ``gradcomp.torch`` (that module re-exports this one). Two routes run the same
C++ code:

* ``hook = gradcomp.torch.register(ddp_model, gradcomp.Q4())`` installs a C++
  ``c10d::CommHookInterface`` on ``ddp_model.reducer``; CPU buckets are compressed on a worker
  thread without the GIL.
* ``ddp_model.register_comm_hook(gradcomp.torch.HookState(gradcomp.Q4()), gradcomp.torch.comm_hook)``
  is the standard Python hook route.
"""

import torch
import torch.distributed as dist

from . import _C
from .codecs import NoCompression, Q4, TopK

__all__ = ["register", "Hook", "HookState", "comm_hook"]


def _options(codec) -> dict:
    codec = Q4() if codec is None else codec
    if not isinstance(codec, (Q4, TopK, NoCompression)):
        raise ValueError(f"codec must be gradcomp.Q4, gradcomp.TopK or gradcomp.NoCompression, got {codec!r}")
    return codec._options()


class Hook:
    """Handle to a registered hook: statistics and checkpointable state (one per rank)."""

    def __init__(self, native, codec):
        self._native = native
        self.codec = codec

    def stats(self) -> dict:
        """Bytes sent, uncompressed bytes, ratio, codec and communication seconds: for the last
        step ("step") and since registration ("total")."""
        return {"step": self._native.last_step_stats(), "total": self._native.total_stats()}

    def state_dict(self) -> dict:
        """This rank's residuals (by stable bucket identity), step counter and seed."""
        return self._native.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores state saved by ``state_dict`` on the same rank; the run then continues
        bit-identically to one that never stopped."""
        self._native.load_state_dict(state_dict)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, codec=None) -> Hook:
    """Installs gradcomp as ``ddp_model``'s communication hook (call before the first backward).

    ``codec`` defaults to ``gradcomp.Q4()``. DDP allows one hook per model.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    native = _C.DdpHook(ddp_model.process_group, _options(codec))
    # Buckets are recorded by parameter position, so a restart can reduce the saved layout.
    native.set_parameters(list(ddp_model.parameters()))
    _C.install_hook(ddp_model.reducer, native)
    return Hook(native, Q4() if codec is None else codec)


class HookState(Hook):
    """State object for the standard route: ``ddp_model.register_comm_hook(state, comm_hook)``."""

    def __init__(self, codec=None, process_group=None):
        self._options = _options(codec)
        self._group = process_group
        super().__init__(None, Q4() if codec is None else codec)

    def _ensure_native(self):
        if self._native is None:
            group = self._group if self._group is not None else dist.distributed_c10d._get_default_group()
            self._native = _C.DdpHook(group, self._options)
        return self._native

    def stats(self) -> dict:
        self._ensure_native()
        return super().stats()

    def state_dict(self) -> dict:
        self._ensure_native()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._ensure_native()
        super().load_state_dict(state_dict)


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` over the ranks with gradcomp, in place."""
    native = state._ensure_native()
    buffer = bucket.buffer()
    shapes = [list(p.shape) for p in bucket.parameters()]
    native.reduce_bucket(buffer, bucket.index(), shapes, bucket.is_last())
    future = torch.futures.Future()
    future.set_result(buffer)
    return future

"""Every difference between the PyTorch versions gradcomp supports (2.7 to 2.15) that Python sees,
and the check that the extension was built for the installed torch."""
from __future__ import annotations

import importlib.machinery
import pathlib
import re

import torch

MIN_TORCH = (2, 7)
_MARK = re.compile(rb"gradcomp-built-for-torch=([0-9][0-9A-Za-z.+]*);")


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def built_for_torch(package_dir: pathlib.Path):
    """The torch version the extension in ``package_dir`` was built against, read from its bytes
    without loading it; None when there is no extension or it does not say."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_C{suffix}"
        if path.exists():
            found = _MARK.search(path.read_bytes())
            return found.group(1).decode() if found else None
    return None


def check_built_for_installed_torch(package_dir: pathlib.Path | None = None) -> None:
    """Raises ImportError naming both versions when the extension was built for another torch
    minor release (the C++ ABI changes between them): the fix is to rebuild against the one
    installed."""
    if _major_minor(torch.__version__) < MIN_TORCH:
        raise ImportError(f"gradcomp needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer; torch "
                          f"{torch.__version__} is installed")
    built = built_for_torch(package_dir or pathlib.Path(__file__).parent)
    if built is not None and _major_minor(built) != _major_minor(torch.__version__):
        raise ImportError(f"gradcomp's extension was built against torch {built}, but torch {torch.__version__} "
                          f"is installed: rebuild it against the installed torch with "
                          f"`pip install --no-build-isolation .` (or install the torch it was built for)")


_COMPILED_AUTOGRAD = ("gradcomp: a backward under compiled autograd skips DDP's C++ reducer, which runs gradcomp's "
                      "hook (torch {version} then averages no gradient at all). Run backward without compiled "
                      "autograd; torch.compile of the model with the default optimize_ddp keeps the hook.")


def guard_against_compiled_autograd(param: torch.Tensor) -> None:
    """Makes a backward under compiled autograd raise once ``param``'s gradient is accumulated.
    torch 2.15's reducer raises there itself; older ones (2.7 at least) silently skip the reducer,
    and with it every bucket's averaging. Compiled autograd runs the Python hook in its graph."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    def check(_):
        if compiled_autograd.in_compiled_autograd_region:
            raise RuntimeError(_COMPILED_AUTOGRAD.format(version=torch.__version__))

    param.register_post_accumulate_grad_hook(check)


def fsdp_reduce_scatter_api():
    """FSDP2's ``FSDPModule`` and its ``ReduceScatter`` comm interface, or RuntimeError naming the
    installed torch: ``set_custom_reduce_scatter`` came in 2.9 (the 2.8.0 wheel lacks it, 2.9.0 has it
    with the interface 2.15 has)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        FSDPModule = ReduceScatter = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(f"gradcomp.torch.fsdp needs FSDP2's FSDPModule.set_custom_reduce_scatter, which torch "
                           f"{torch.__version__} lacks (it came in torch 2.9): upgrade torch to 2.9 or newer, or use "
                           f"gradcomp.torch.register with DistributedDataParallel")
    return FSDPModule, ReduceScatter


def fsdp_all_gather_api():
    """FSDP2's ``AllGather`` comm interface, or RuntimeError naming the installed torch:
    ``set_custom_all_gather`` came with ``set_custom_reduce_scatter`` (PR #155189, torch 2.9)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
    except ImportError:
        FSDPModule = AllGather = None
    if FSDPModule is None or not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(f"gradcomp.torch.fsdp(params=...) needs FSDP2's FSDPModule.set_custom_all_gather, which "
                           f"torch {torch.__version__} lacks (it came in torch 2.9): upgrade torch to 2.9 or newer, or "
                           f"leave params unset (FSDP then all-gathers the weights itself, uncompressed)")
    return AllGather


def fsdp_param_group(module):
    """The one FSDP parameter group of a ``fully_shard`` module (None for a module without parameters of
    its own), from FSDP2's private state: the custom all-gather needs its shard group, its parameters'
    dtypes and sizes, and whether it runs before backward, none of which FSDP passes to the comm."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # before per-parameter meshes: one group or none
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    if len(groups) > 1:
        raise ValueError("gradcomp.torch.fsdp(params=...): a fully_shard module with several parameter groups "
                         "(per-parameter meshes through shard_placement_fn) is refused, as FSDP's "
                         "set_custom_all_gather refuses it")
    return groups[0] if groups else None


def fsdp_in_backward(param_group) -> bool:
    """Whether the param group's all-gather is the one before its backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return param_group._training_state == TrainingState.PRE_BACKWARD


def premul_factor(op) -> float:
    """The factor of a ``ReduceOp.PREMUL_SUM(factor)`` as FSDP2 passes it: ``op.factor`` where torch has
    it (2.15), else read from the op's C++ supplement (2.9 and 2.11 expose no accessor)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        from . import _C

        try:
            factor = _C.premul_sum_factor(op)
        except (RuntimeError, TypeError) as e:
            raise RuntimeError(f"gradcomp: cannot read the factor of {op!r} on torch {torch.__version__}: {e}") from e
    return float(factor)

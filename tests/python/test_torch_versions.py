"""The extension knows the torch it was built against, and refuses another one by name."""
import importlib.machinery
import pathlib
import re

import pytest
import torch

import gradcomp
from gradcomp import _C, _torch_compat


def _major_minor(v):
    return tuple(int(x) for x in v.split("+")[0].split(".")[:2])


def test_the_extension_was_built_for_the_installed_torch():
    package = pathlib.Path(gradcomp.__file__).parent
    built = _torch_compat.built_for_torch(package)
    assert built == _C.built_for_torch, (built, _C.built_for_torch)
    assert _major_minor(built) == _major_minor(torch.__version__)
    assert _major_minor(built) >= _torch_compat.MIN_TORCH


@pytest.mark.parametrize("built", ["2.6.0", "9.99.1"])
def test_an_extension_built_for_another_torch_is_refused_before_it_loads(tmp_path, built):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    # Not a loadable module: the check must decide from the bytes alone.
    (tmp_path / f"_C{suffix}").write_bytes(b"\x7fELF...gradcomp-built-for-torch=" + built.encode() + b";...")
    with pytest.raises(ImportError, match=re.escape(f"built against torch {built}, but torch {torch.__version__}")):
        _torch_compat.check_built_for_installed_torch(tmp_path)
    same = torch.__version__.split("+")[0]
    (tmp_path / f"_C{suffix}").write_bytes(b"gradcomp-built-for-torch=" + same.encode() + b";")
    _torch_compat.check_built_for_installed_torch(tmp_path)


@pytest.mark.skipif(hasattr(getattr(__import__("torch.distributed.fsdp", fromlist=["x"]), "FSDPModule", None),
                            "set_custom_reduce_scatter"),
                    reason=f"torch {torch.__version__} has FSDPModule.set_custom_reduce_scatter (test_fsdp.py covers it)")
def test_fsdp_on_a_torch_without_its_hook_point_is_refused_by_name():
    import gradcomp.torch as gt

    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} lacks")):
        gt.fsdp(torch.nn.Linear(2, 2), gradcomp.Q4())


def test_the_premul_sum_factor_fsdp_passes_is_read_on_every_torch():
    """FSDP divides through PREMUL_SUM(1 / factor); torch 2.9 and 2.11 give its ReduceOp no ``factor``."""
    import torch.distributed as dist

    assert _C.premul_sum_factor(dist._make_nccl_premul_sum(0.25)) == 0.25
    assert _C.premul_sum_factor(dist._make_nccl_premul_sum(torch.tensor([0.125], dtype=torch.float64))) == 0.125
    assert _torch_compat.premul_factor(dist._make_nccl_premul_sum(1 / 3)) == 1 / 3
    with pytest.raises(RuntimeError, match="is not PREMUL_SUM"):
        _C.premul_sum_factor(dist.ReduceOp(dist.ReduceOp.SUM))

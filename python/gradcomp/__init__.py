"""gradcomp: compressed gradient communication for data-parallel PyTorch training.

Codec specs (``Q4``, ``TopK``, ``Q2`` (DiLoCo's outer gradients), ``NoCompression``) describe what a hook does; ``compress`` and
``decompress`` encode one tensor into a gradcomp payload and back. The DDP hook is
``gradcomp.torch.register`` (or the standard route, ``gradcomp.torch.comm_hook``).
"""
# _C needs torch's libraries loaded first (a wheel's extension cannot point at the torch it was
# built against), and a torch other than that one would not load it: checked before anything
# imports it.
from ._torch_compat import check_built_for_installed_torch

check_built_for_installed_torch()
from .codecs import Int4, Int8, NoCompression, Q2, Q4, TopK, compress, decompress  # noqa: E402
from . import _C  # noqa: E402

__all__ = ["Q4", "TopK", "Q2", "Int8", "Int4", "NoCompression", "compress", "decompress", "with_cuda"]

with_cuda: bool = bool(_C.with_cuda)

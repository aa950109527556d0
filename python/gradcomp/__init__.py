"""gradcomp: compressed gradient communication for data-parallel PyTorch training.

Codec specs (``Q4``, ``TopK``, ``NoCompression``) describe what a hook does; ``compress`` and
``decompress`` encode one tensor into a gradcomp payload and back. The DDP hook is
``gradcomp.torch.register`` (or the standard route, ``gradcomp.torch.comm_hook``).
"""
# codecs imports torch before the extension: _C needs torch's libraries loaded (a wheel's
# extension cannot point at the torch it was built against).
from .codecs import NoCompression, Q4, TopK, compress, decompress
from . import _C  # noqa: E402

__all__ = ["Q4", "TopK", "NoCompression", "compress", "decompress", "with_cuda"]

with_cuda: bool = bool(_C.with_cuda)

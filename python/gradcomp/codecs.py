"""Codec specs (``Q4``, ``TopK``, ``Q2``, ``NoCompression``) and standalone ``compress`` / ``decompress``."""
from __future__ import annotations

import dataclasses

import torch

from . import _C  # registers torch.ops.gradcomp.*

__all__ = ["Q4", "TopK", "Q2", "NoCompression", "compress", "decompress"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _dtype_name(dtype: torch.dtype, what: str, allowed=tuple(_DTYPE_NAMES)) -> str:
    _check(dtype in allowed, f"{what} must be one of {[str(d) for d in allowed]}, got {dtype!r}")
    return _DTYPE_NAMES[dtype]


def _check_seed(seed: int) -> None:
    _check(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64,
           f"seed must be an int in [0, 2**64), got {seed!r}")


_KERNELS = ("default", "v1", "v2")


def _check_kernels(kernels: str, codec: str) -> None:
    _check(kernels in _KERNELS,
           f"{codec} kernels must be one of {', '.join(map(repr, _KERNELS))}, got {kernels!r}")


def _check_piece_numel(piece_numel: int, codec: str) -> None:
    _check(isinstance(piece_numel, int) and not isinstance(piece_numel, bool)
           and 0 <= piece_numel <= 2**31,
           f"{codec} piece_numel must be an int in [0, 2**31] (0: each bucket whole), got {piece_numel!r}")


@dataclasses.dataclass(frozen=True)
class Q4:
    """4-bit block quantization: one fp32 step per ``block_size`` elements, codes in [-7, 7].

    ``rounding``: "stochastic" (unbiased, default) or "nearest". ``algorithm``: "two_phase"
    (all-to-all then allgather; traffic independent of world size) or "one_phase" (allgather).
    ``error_feedback`` keeps what was dropped and adds it to the next step's gradient;
    ``residual_dtype`` is torch.float32 or torch.bfloat16. ``piece_numel``: two-phase runs a
    bucket as pieces of about this many elements, encoding the next piece while one is on the
    wire, and on the CPU the next bucket is encoded while this one's last pieces are on the wire
    (the result is the same for any size; 0: each bucket whole, one after another).
    ``kernels``: the CUDA kernels used on a CUDA device: "v1" (the default), "v2" (opt-in: the
    rewritten kernels, same bytes, not yet proven on a GPU) or "default" (the environment
    variable ``GRADCOMP_KERNELS``, else v1). The CPU ignores it.
    """

    block_size: int = 64
    rounding: str = "stochastic"
    algorithm: str = "two_phase"
    error_feedback: bool = True
    residual_dtype: torch.dtype = torch.float32
    seed: int = 0
    piece_numel: int = _C.q4_default_piece_numel
    kernels: str = "default"

    def __post_init__(self):
        sizes = _C.q4_block_sizes
        _check(isinstance(self.block_size, int) and not isinstance(self.block_size, bool)
               and self.block_size in sizes,
               f"Q4 block_size must be one of {', '.join(map(str, sizes))}, got {self.block_size!r}")
        _check(self.rounding in ("stochastic", "nearest"),
               f"Q4 rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")
        _check(self.algorithm in ("two_phase", "one_phase"),
               f"Q4 algorithm must be 'two_phase' or 'one_phase', got {self.algorithm!r}")
        _check(isinstance(self.error_feedback, bool), "Q4 error_feedback must be a bool")
        _dtype_name(self.residual_dtype, "Q4 residual_dtype", (torch.float32, torch.bfloat16))
        _check_seed(self.seed)
        _check_piece_numel(self.piece_numel, "Q4")
        _check_kernels(self.kernels, "Q4")

    def _options(self) -> dict:
        return {"codec": "q4", "block_size": self.block_size, "rounding": self.rounding,
                "algorithm": self.algorithm, "error_feedback": self.error_feedback,
                "residual_dtype": _DTYPE_NAMES[self.residual_dtype], "seed": self.seed,
                "piece_numel": self.piece_numel, "kernels": self.kernels}


@dataclasses.dataclass(frozen=True)
class TopK:
    """Top-k sparsification: the ``ceil(ratio * N)`` largest magnitudes of each bucket.

    ``exact=True`` selects exactly k (ties to the lower index); ``exact=False`` uses a threshold
    estimated from a sample and one pass. ``value_dtype``: torch.float32, float16 or bfloat16.

    Deep Gradient Compression's remedies (docs/algorithms.md), all off by default:
    ``warmup_steps`` / ``warmup_stages``: the density rises from ratio**(1/(stages+1)) to ``ratio``
    in ``warmup_stages`` equal stages over the first ``warmup_steps`` steps; with ``warmup="q4"``
    the first ``warmup_steps`` steps send the whole bucket as two-phase q4 instead, then top-k at
    ``ratio`` (it helped AdamW on one model and not on another: with Adam-family optimizers use Q4 or
    DiLoCo; docs/benchmarks.md). ``momentum``: momentum
    correction; the velocity ``u = momentum * u + g`` is what is accumulated and sparsified, and
    the optimizer must be SGD with ``momentum=0`` (``gradcomp.check_optimizer``).
    ``momentum_masking``: sent coordinates are cleared from the velocity too. ``clip_norm``:
    each rank clips a bucket's gradient to a norm of ``clip_norm / sqrt(world_size)`` first.
    ``piece_numel``: as Q4's, for the q4 warm-up's pieces and the overlap of consecutive buckets
    (on the CPU, a bucket's selection runs while the one before is on the wire; 0: each bucket
    whole, one after another). ``kernels``: as Q4's.
    """

    ratio: float = 0.01
    exact: bool = True
    error_feedback: bool = True
    value_dtype: torch.dtype = torch.float32
    residual_dtype: torch.dtype = torch.float32
    seed: int = 0
    warmup_steps: int = 0
    warmup_stages: int = 4
    warmup: str = "sparsity"
    momentum: float = 0.0
    momentum_masking: bool = True
    clip_norm: float = 0.0
    piece_numel: int = _C.q4_default_piece_numel
    kernels: str = "default"

    def __post_init__(self):
        _check(isinstance(self.ratio, (int, float)) and not isinstance(self.ratio, bool)
               and 0.0 < float(self.ratio) <= 1.0, f"TopK ratio must be in (0, 1], got {self.ratio!r}")
        _check(isinstance(self.exact, bool), "TopK exact must be a bool")
        _check(isinstance(self.error_feedback, bool), "TopK error_feedback must be a bool")
        _dtype_name(self.value_dtype, "TopK value_dtype")
        _dtype_name(self.residual_dtype, "TopK residual_dtype", (torch.float32, torch.bfloat16))
        _check_seed(self.seed)
        for name in ("warmup_steps", "warmup_stages"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32,
                   f"TopK {name} must be an int in [0, 2**32), got {v!r}")
        _check(self.warmup in ("sparsity", "q4"), f"TopK warmup must be 'sparsity' or 'q4', got {self.warmup!r}")
        _check(1 <= self.warmup_stages <= 64, f"TopK warmup_stages must be in [1, 64], got {self.warmup_stages!r}")
        _check(isinstance(self.momentum, (int, float)) and not isinstance(self.momentum, bool)
               and 0.0 <= float(self.momentum) < 1.0, f"TopK momentum must be in [0, 1), got {self.momentum!r}")
        _check(isinstance(self.momentum_masking, bool), "TopK momentum_masking must be a bool")
        _check(isinstance(self.clip_norm, (int, float)) and not isinstance(self.clip_norm, bool)
               and 0.0 <= float(self.clip_norm) < float("inf"),
               f"TopK clip_norm must be a finite number >= 0 (0: off), got {self.clip_norm!r}")
        _check(self.momentum == 0 or self.error_feedback,
               "TopK momentum correction needs error_feedback=True")
        _check_piece_numel(self.piece_numel, "TopK")
        _check_kernels(self.kernels, "TopK")

    def _options(self) -> dict:
        return {"codec": "topk", "ratio": float(self.ratio), "exact": self.exact,
                "error_feedback": self.error_feedback, "value_dtype": _DTYPE_NAMES[self.value_dtype],
                "residual_dtype": _DTYPE_NAMES[self.residual_dtype], "seed": self.seed,
                "warmup_steps": self.warmup_steps, "warmup_stages": self.warmup_stages,
                "warmup": self.warmup,
                "momentum": float(self.momentum), "momentum_masking": self.momentum_masking,
                "clip_norm": float(self.clip_norm), "piece_numel": self.piece_numel,
                "kernels": self.kernels}


@dataclasses.dataclass(frozen=True)
class Q2:
    """2-bit block quantization with error feedback, for DiLoCo's outer gradients (``gradcomp.torch.diloco``).

    Four levels ``{-1.5, -0.5, 0.5, 1.5} * d`` per ``block_size`` elements, ``d`` a bfloat16 step: about 2.25 bits
    per element at the default block size of 64, scales included. ``rounding``: "stochastic" (unbiased, default)
    or "nearest". ``error_feedback`` keeps what rounding dropped for the next round; ``residual_dtype`` is
    torch.float32 or torch.bfloat16; ``piece_numel`` as Q4's. ``kernels`` as Q4's, except that Q2 has only v2
    CUDA kernels: a CUDA model needs ``kernels="v2"`` (or ``GRADCOMP_KERNELS=v2``), and is refused by name under
    v1. Only DiLoCo takes it: its accuracy in per-step training (the DDP hook, FSDP) is not measured.
    """

    block_size: int = 64
    rounding: str = "stochastic"
    error_feedback: bool = True
    residual_dtype: torch.dtype = torch.float32
    seed: int = 0
    piece_numel: int = _C.q4_default_piece_numel
    kernels: str = "default"

    def __post_init__(self):
        sizes = _C.q4_block_sizes  # q2 blocks follow q4's rule
        _check(isinstance(self.block_size, int) and not isinstance(self.block_size, bool)
               and self.block_size in sizes,
               f"Q2 block_size must be one of {', '.join(map(str, sizes))}, got {self.block_size!r}")
        _check(self.rounding in ("stochastic", "nearest"),
               f"Q2 rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")
        _check(isinstance(self.error_feedback, bool), "Q2 error_feedback must be a bool")
        _dtype_name(self.residual_dtype, "Q2 residual_dtype", (torch.float32, torch.bfloat16))
        _check_seed(self.seed)
        _check_piece_numel(self.piece_numel, "Q2")
        _check_kernels(self.kernels, "Q2")

    def _options(self) -> dict:
        return {"codec": "q2", "block_size": self.block_size, "rounding": self.rounding,
                "error_feedback": self.error_feedback, "residual_dtype": _DTYPE_NAMES[self.residual_dtype],
                "seed": self.seed, "piece_numel": self.piece_numel, "kernels": self.kernels}


def refuse_q2(codec, front_end: str) -> None:
    """Per-step front ends refuse Q2 by name (the core does too)."""
    if isinstance(codec, Q2):
        raise ValueError(f"{front_end} does not take gradcomp.Q2: Q2 is meant for DiLoCo's outer gradients "
                         f"(gradcomp.torch.diloco); its accuracy in per-step training is not measured. Use gradcomp.Q4")


@dataclasses.dataclass(frozen=True)
class Int8:
    """Block-scaled int8 for FSDP's parameter all-gathers (``gradcomp.torch.fsdp(..., params=Int8())``):
    one bf16 scale per ``block_size`` elements (the block's largest magnitude / 127, rounded up), codes
    rounded to nearest (ties to even) in [-127, 127]. About 8 + 16 / block_size bits per element on the
    wire. Weights are not accumulated, so there is no error feedback and no randomness: the same shard
    gives the same bytes on every call. On the CPU, or on CUDA with ``GRADCOMP_KERNELS=v2`` (under v1, CUDA
    parameters are refused naming that switch)."""

    block_size: int = 64

    def __post_init__(self):
        b = self.block_size
        _check(isinstance(b, int) and not isinstance(b, bool) and 16 <= b <= 4096 and b & (b - 1) == 0,
               f"Int8 block_size must be a power of two in [16, 4096], got {b!r}")

    def _options(self) -> dict:
        return {"codec": "int8", "block_size": self.block_size}


@dataclasses.dataclass(frozen=True)
class Int4:
    """Block-scaled 4-bit weights for FSDP's parameter all-gathers (``gradcomp.torch.fsdp(..., params=Int4())``):
    Int8's rules with codes rounded to nearest (ties to even) in [-7, 7], one bf16 scale per ``block_size``
    elements (the block's largest magnitude / 7, rounded up), two codes per byte: about 4 + 16 / block_size bits
    per element (docs/format.md, GCW4). The default block of 32 is the measured best on the convergence LM
    (+0.51 % over FSDP fp32 on 3 seeds, docs/benchmarks.md). On CUDA it runs the v2 kernels only
    (``GRADCOMP_KERNELS=v2``; under v1 CUDA parameters are refused by name), not yet proven on a GPU
    (docs/gpu-results.md)."""

    block_size: int = 32

    def __post_init__(self):
        b = self.block_size
        _check(isinstance(b, int) and not isinstance(b, bool) and 16 <= b <= 4096 and b & (b - 1) == 0,
               f"Int4 block_size must be a power of two in [16, 4096], got {b!r}")

    def _options(self) -> dict:
        return {"codec": "int4", "block_size": self.block_size}


@dataclasses.dataclass(frozen=True)
class NoCompression:
    """Plain allreduce through gradcomp's hook path, for A/B comparisons."""

    def _options(self) -> dict:
        return {"codec": "none", "error_feedback": False, "residual_dtype": "float32", "seed": 0}


def compress(tensor: torch.Tensor, codec=None, *, step: int = 0) -> torch.Tensor:
    """Encodes ``tensor`` (float32/float16/bfloat16, CPU or CUDA) into a uint8 payload tensor."""
    codec = Q4() if codec is None else codec
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compress expects a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(codec, Q4):
        return torch.ops.gradcomp.q4_compress(tensor.reshape(-1), codec.block_size,
                                              codec.rounding == "stochastic", codec.seed, step)
    if isinstance(codec, Q2):  # on CUDA under the v2 kernels only (GRADCOMP_KERNELS=v2), refused by name else
        return torch.ops.gradcomp.q2_compress(tensor.reshape(-1), codec.block_size,
                                              codec.rounding == "stochastic", codec.seed, step)
    if isinstance(codec, TopK):
        return torch.ops.gradcomp.topk_compress(tensor.reshape(-1), float(codec.ratio), codec.exact,
                                                codec.value_dtype)
    raise ValueError(f"compress needs a Q4, Q2 or TopK codec, got {codec!r}")


def decompress(payload: torch.Tensor) -> torch.Tensor:
    """Decodes a payload from ``compress`` into a flat tensor of the original dtype."""
    return torch.ops.gradcomp.decompress(payload)

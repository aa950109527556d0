"""An independent pure-PyTorch implementation of gradcomp's q4 (and q2) two-phase and top-k algorithms.

Written from docs/algorithms.md and docs/format.md, sharing no code with the library, so that the
hook's results can be checked bit for bit.
"""
from __future__ import annotations

import math

import torch

MASK = 0xFFFFFFFF


def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding 32-bit values."""
    c = [c0, c1, c2, c3]
    for _ in range(10):
        p0 = c[0] * 0xD2511F53
        p1 = c[2] * 0xCD9E8D57
        hi0, lo0 = (p0 >> 32) & MASK, p0 & MASK
        hi1, lo1 = (p1 >> 32) & MASK, p1 & MASK
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0 = (k0 + 0x9E3779B9) & MASK
        k1 = (k1 + 0xBB67AE85) & MASK
    return c


def random16(elements: torch.Tensor, seed: int, step: int, bucket: int, rank: int, phase: int) -> torch.Tensor:
    group = elements // 8
    lane = elements % 8
    k0 = (seed & MASK) ^ ((rank * 0x9E3779B9) & MASK)
    k1 = ((seed >> 32) & MASK) ^ ((phase * 0xBB67AE85) & MASK)
    zeros = torch.zeros_like(group)
    words = philox(group & MASK, (group >> 32) & MASK, zeros + (step & MASK), zeros + (bucket & MASK), k0, k1)
    w = torch.stack(words)[lane // 2, torch.arange(len(lane))]
    return torch.where(lane % 2 == 1, w >> 16, w & 0xFFFF)


def abs_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def q4_encode(acc: torch.Tensor, residual: torch.Tensor, first: int, block: int, stochastic: bool,
              seed: int, step: int, bucket: int, rank: int, phase: int):
    """Returns (steps per block, codes per element, new residual) for fp32 acc = input + residual."""
    n = acc.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block - n, dtype=torch.float32)
    bits = abs_bits(torch.cat([acc, pad])).view(nb, block)
    absmax = bits.max(dim=1).values if n > 0 else torch.zeros(0, dtype=torch.int64)
    s = absmax.to(torch.int32).view(torch.float32)
    d0 = (s / 7.0).view(torch.int32).to(torch.int64)
    d = torch.where(d0 == 0, torch.full_like(d0, 8), (d0 + 7) & ~7)
    d = torch.where(absmax == 0, torch.zeros_like(d), d)
    step_val = d.to(torch.int32).view(torch.float32)
    step_val = torch.where(absmax >= 0x7F800000, torch.full_like(step_val, float("nan")), step_val)
    per_elem = step_val.repeat_interleave(block)[:n]
    positive = per_elem > 0
    safe = torch.where(positive, per_elem, torch.ones_like(per_elem))
    t = (acc / safe).clamp(-7.0, 7.0)
    tr = t.trunc()
    fl = torch.where(tr > t, tr - 1.0, tr)
    frac = t - fl
    q = fl.to(torch.int64)
    if stochastic:
        r16 = random16(torch.arange(first, first + n, dtype=torch.int64), seed, step, bucket, rank, phase)
        bar = r16.to(torch.float32) * (1.0 / 65536.0)
    else:
        bar = torch.where(q % 2 != 0, torch.full_like(frac, 0.49999997), torch.full_like(frac, 0.5))
    q = torch.clamp(q + (bar < frac).to(torch.int64), max=7)
    q = torch.where(positive, q, torch.zeros_like(q))
    decoded = q.to(torch.float32) * per_elem
    finite_block = (absmax < 0x7F800000).repeat_interleave(block)[:n]
    new_residual = torch.where(finite_block, acc - decoded, residual)
    return decoded, new_residual


def q2_encode(acc: torch.Tensor, residual: torch.Tensor, first: int, block: int, stochastic: bool,
              seed: int, step: int, bucket: int, rank: int, phase: int):
    """q2 (docs/algorithms.md): the step d is the smallest bfloat16 with 1.5 d >= absmax; codes c in 0..3 stand
    for (c - 1.5) d; u = x / d + 1.5 rounds up with probability frac(u), or to nearest with ties away from 0."""
    n = acc.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block - n, dtype=torch.float32)
    absmax = abs_bits(torch.cat([acc, pad])).view(nb, block).max(dim=1).values if n > 0 else \
        torch.zeros(0, dtype=torch.int64)
    a = absmax.to(torch.int32).view(torch.float32)
    d = ((a / 1.5).view(torch.int32).to(torch.int64) + 0xFFFF) & ~0xFFFF
    step_val = torch.where(absmax == 0, torch.zeros_like(d), d).to(torch.int32).view(torch.float32)
    step_val = torch.where(absmax >= 0x7F800000, torch.full_like(step_val, float("nan")), step_val)
    per_elem = step_val.repeat_interleave(block)[:n]
    positive = per_elem > 0
    safe = torch.where(positive, per_elem, torch.ones_like(per_elem))
    u = (acc / safe + 1.5).clamp(0.0, 3.0)
    fl = u.trunc()
    frac = u - fl
    c = fl.to(torch.int64)
    if stochastic:
        r16 = random16(torch.arange(first, first + n, dtype=torch.int64), seed, step, bucket, rank, phase)
        bar = r16.to(torch.float32) * (1.0 / 65536.0)
    else:
        bar = torch.where(c >= 1, torch.full_like(frac, 0.49999997), torch.full_like(frac, 0.5))
    c = torch.clamp(c + (bar < frac).to(torch.int64), max=3)
    c = torch.where(positive, c, torch.full_like(c, 2))
    decoded = (c.to(torch.float32) - 1.5) * per_elem
    finite_block = (absmax < 0x7F800000).repeat_interleave(block)[:n]
    new_residual = torch.where(finite_block, acc - decoded, residual)
    return decoded, new_residual


class Q4TwoPhase:
    """Keeps every rank's residuals; step() returns the averaged bucket all ranks end with. ``encode``:
    q4_encode, or q2_encode for q2's two-phase (the same chunks, keys and residuals)."""

    def __init__(self, world: int, n: int, block: int = 64, stochastic: bool = True, seed: int = 0,
                 key_ranks=None, encode=q4_encode):
        self.world, self.n, self.block, self.stochastic, self.seed = world, n, block, stochastic, seed
        self.encode = encode
        # The rank each member's random bits are keyed by: its place, or (across nodes) its global rank.
        self.keys = list(range(world)) if key_ranks is None else list(key_ranks)
        self.chunk = max(block, -(-(-(-n // world)) // block) * block)
        self.res1 = [torch.zeros(n) for _ in range(world)]
        self.res2 = [torch.zeros(self.chunk) for _ in range(world)]

    def _range(self, c):
        lo = min(self.n, c * self.chunk)
        return lo, min(self.n, (c + 1) * self.chunk)

    def step(self, grads, step: int, bucket: int) -> torch.Tensor:
        decoded = [[None] * self.world for _ in range(self.world)]
        for w in range(self.world):
            new_res = self.res1[w].clone()
            for c in range(self.world):
                lo, hi = self._range(c)
                acc = grads[w][lo:hi] + self.res1[w][lo:hi]
                dec, r = self.encode(acc, self.res1[w][lo:hi], c * self.chunk, self.block, self.stochastic,
                                   self.seed, step, bucket, self.keys[w], 0)
                decoded[w][c] = dec
                new_res[lo:hi] = r
            self.res1[w] = new_res
        out = torch.zeros(self.n)
        for c in range(self.world):
            lo, hi = self._range(c)
            total = torch.zeros(hi - lo)
            for w in range(self.world):
                total = total + decoded[w][c]
            acc = total + self.res2[c][: hi - lo]
            dec, r = self.encode(acc, self.res2[c][: hi - lo], c * self.chunk, self.block, self.stochastic,
                               self.seed, step, bucket, self.keys[c], 1)
            self.res2[c][: hi - lo] = r
            out[lo:hi] = dec / float(self.world)
        return out


class TopKExact:
    def __init__(self, world: int, n: int, ratio: float):
        self.world, self.n = world, n
        self.k = min(n, max(1, math.ceil(ratio * n)))
        self.res = [torch.zeros(n) for _ in range(world)]

    def step(self, grads) -> torch.Tensor:
        sums = torch.zeros(self.n)
        for w in range(self.world):
            acc = grads[w] + self.res[w]
            order = torch.sort(abs_bits(acc), descending=True, stable=True).indices[: self.k]
            idx = torch.sort(order).values
            sums[idx] = sums[idx] + acc[idx]
            res = acc.clone()
            res[idx] = acc[idx] - acc[idx]
            self.res[w] = res
        return sums / float(self.world)


class TopKQ4Warmup:
    """Top-k with a q4 warm-up: two-phase q4 for the first warmup_steps steps, then exact top-k
    whose residual starts from q4's whole-bucket residual (the own-chunk residuals end)."""

    def __init__(self, world: int, n: int, ratio: float, warmup_steps: int, seed: int = 0, key_ranks=None):
        self.q4 = Q4TwoPhase(world, n, seed=seed, key_ranks=key_ranks)
        self.topk = TopKExact(world, n, ratio)
        self.warmup_steps = warmup_steps

    def step(self, grads, step: int, bucket: int) -> torch.Tensor:
        if step < self.warmup_steps:
            return self.q4.step(grads, step, bucket)
        if step == self.warmup_steps:
            self.topk.res = [r.clone() for r in self.q4.res1]
        return self.topk.step(grads)


class TopKDgc:
    """Top-k with Deep Gradient Compression's remedies (docs/algorithms.md), written plainly:
    per rank a velocity u and an accumulator v; g clipped to clip_norm / sqrt(W) (squares summed
    in 4096-element chunks, in order), u = m * u + g, v = v + u, the k largest |v| sent and
    cleared from v (and from u with masking); k follows the warm-up schedule."""

    def __init__(self, world: int, n: int, ratio: float, momentum=0.0, masking=True, clip_norm=0.0,
                 warmup_steps=0, warmup_stages=4):
        import numpy as np  # noqa: PLC0415 (numpy's float32 cumsum adds in order)
        self.np = np
        self.world, self.n, self.ratio = world, n, ratio
        self.m = np.float32(momentum)
        self.masking, self.clip = masking, np.float32(clip_norm)
        self.warmup_steps, self.warmup_stages = warmup_steps, warmup_stages
        self.u = [torch.zeros(n) for _ in range(world)]
        self.v = [torch.zeros(n) for _ in range(world)]

    def ratio_at(self, step: int) -> float:
        if step >= self.warmup_steps:
            return self.ratio
        stage = step * self.warmup_stages // self.warmup_steps
        return self.ratio ** ((stage + 1) / (self.warmup_stages + 1))

    def _clipped(self, g: torch.Tensor) -> torch.Tensor:
        np = self.np
        if self.clip == 0:
            return g
        x = g.numpy()
        total = np.float32(0)
        for first in range(0, self.n, 4096):
            sq = x[first:first + 4096] * x[first:first + 4096]
            total = np.float32(total + np.cumsum(sq, dtype=np.float32)[-1])
        threshold = np.float32(np.float64(self.clip) / math.sqrt(self.world))
        norm = np.sqrt(total)
        if norm > threshold:
            return g * torch.tensor(np.float32(threshold / norm))
        return g

    def step(self, grads, step: int) -> torch.Tensor:
        k = min(self.n, max(1, math.ceil(self.ratio_at(step) * self.n)))
        sums = torch.zeros(self.n)
        for w in range(self.world):
            g = self._clipped(grads[w])
            if self.m > 0:
                self.u[w] = torch.tensor(self.m) * self.u[w] + g
                acc = self.u[w] + self.v[w]
            else:
                acc = g + self.v[w]
            order = torch.sort(abs_bits(acc), descending=True, stable=True).indices[:k]
            idx = torch.sort(order).values
            sums[idx] = sums[idx] + acc[idx]
            acc[idx] = 0.0
            self.v[w] = acc
            if self.m > 0 and self.masking:
                self.u[w][idx] = 0.0
        return sums / float(self.world)


class Q4ReduceScatter:
    """gradcomp's q4 reduce-scatter over every rank's rows (docs/algorithms.md): each rank encodes each
    row on its own (blocks from the row's head, random bits of phase 2 + row), rank r decodes and sums
    row r in rank order and divides; a non-finite input is sent with NaN at the head of every row, and
    a rank keeps its residual when its result is not finite."""

    def __init__(self, world: int, block: int = 64, seed: int = 0):
        self.world, self.block, self.seed = world, block, seed
        self.res = None
        self.steps = 0

    def step(self, inputs, step: int, bucket: int, divisor: float):
        """inputs[w]: rank w's (world, shard) rows; returns every rank's (world, shard) result rows."""
        world, shard = inputs[0].shape
        if self.res is None:
            self.res = [torch.zeros(world, shard) for _ in range(world)]
        decoded = [[None] * world for _ in range(world)]
        new_res = [r.clone() for r in self.res]
        for w in range(world):
            rows = inputs[w].float().clone()
            if not torch.isfinite(rows).all():
                rows[:, 0] = float("nan")
            for r in range(world):
                acc = rows[r] + self.res[w][r]
                dec, res = q4_encode(acc, self.res[w][r], 0, self.block, True, self.seed, step, bucket, w, 2 + r)
                decoded[w][r] = dec
                new_res[w][r] = res
        out = []
        for r in range(world):
            total = torch.zeros(shard)
            for w in range(world):
                total = total + decoded[w][r]
            out.append((total / divisor).to(inputs[0].dtype))
        finite = all(torch.isfinite(o).all() for o in out)
        if finite:
            self.res = new_res
        self.steps += 1
        return torch.stack(out)


def int8_roundtrip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """A 1-D float tensor through block-scaled int8 (docs/format.md, "int8 all-gather payload"), decoded
    back into its dtype: per block, scale = absmax / 127 in fp32 rounded up to bf16 (the smallest positive
    bf16 when that quotient underflows), codes x / scale rounded half to even, decoded as code * scale."""
    f = x.float()
    n = f.numel()
    blocks = torch.cat([f, f.new_zeros(-n % block)]).view(-1, block)
    absmax = blocks.abs().amax(1)
    bits = (absmax / 127.0).view(torch.int32)
    bits = torch.where(bits & 0xFFFF != 0, bits + 0x10000, bits) & -0x10000
    bits = torch.where((bits == 0) & (absmax > 0), torch.full_like(bits, 0x10000), bits)
    scale = bits.view(torch.float32)[:, None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp(-127, 127)
    return (codes * scale + 0.0).reshape(-1)[:n].to(x.dtype)  # + 0.0: a code 0 decodes to +0


def int4_roundtrip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """A 1-D float tensor through block-scaled 4-bit weights (docs/format.md, GCW4), decoded back into its
    dtype: int8_roundtrip's rules with 7 for 127 (scale = absmax / 7 in fp32 rounded up to bf16, codes x / scale
    rounded half to even in [-7, 7], decoded as code * scale)."""
    f = x.float()
    n = f.numel()
    blocks = torch.cat([f, f.new_zeros(-n % block)]).view(-1, block)
    absmax = blocks.abs().amax(1)
    bits = (absmax / 7.0).view(torch.int32)
    bits = torch.where(bits & 0xFFFF != 0, bits + 0x10000, bits) & -0x10000
    bits = torch.where((bits == 0) & (absmax > 0), torch.full_like(bits, 0x10000), bits)
    scale = bits.view(torch.float32)[:, None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp(-7, 7)
    return (codes * scale + 0.0).reshape(-1)[:n].to(x.dtype)


def int8_all_gather(rows: list, runs=None, block: int = 64, roundtrip=int8_roundtrip) -> torch.Tensor:
    """gradcomp's int8 all-gather of every rank's row (1-D, in rank order): each row quantized on its own
    and decoded; with ``runs`` ((dtype, numel) pairs), the rows are bytes of several dtypes and every run
    restarts its blocks. ``roundtrip=int4_roundtrip``: the 4-bit all-gather."""
    out = []
    for row in rows:
        if runs is None:
            out.append(roundtrip(row, block))
            continue
        raw, parts, at = row.view(torch.uint8), [], 0
        for dtype, numel in runs:
            size = numel * torch.empty(0, dtype=dtype).element_size()
            parts.append(roundtrip(raw[at:at + size].view(dtype), block).view(torch.uint8))
            at += size
        out.append(torch.cat(parts))
    return torch.cat(out)


def streaming_merge(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's merge of a round that arrived tau inner steps late: alpha * local + (1 - alpha) *
    global in fp32, each product rounded on its own; alpha = 0 is the global parameters themselves."""
    if alpha == 0.0:
        return global_.clone()
    a = torch.tensor(alpha, dtype=torch.float32)
    return local * a + global_ * (torch.tensor(1.0, dtype=torch.float32) - a)

"""Drives gradcomp's Python entry points with damaged inputs: gradcomp.decompress with mutated
payloads, and a hook's load_state_dict with mutated state dicts. Every call must return or raise
ValueError / RuntimeError / TypeError; anything else, or a crash, fails the run.

    python fuzz/fuzz_python.py [--cases N] [--seed S]     (tests/python/test_fuzz.py runs it)
"""
import argparse
import copy
import os
import random
import struct
import sys
import tempfile

import torch
import torch.distributed as dist

import gradcomp
import gradcomp.torch
from gradcomp import _C

ALLOWED = (ValueError, RuntimeError, TypeError)


def reseal(p: bytearray) -> None:
    """Redoes both checksums (format v2), so that the checks behind them are reached too."""
    if len(p) < 64:
        return
    total = len(p) - (len(p) - 64) % 4
    body = 0
    for i in range((total - 64) // 4):
        (w,) = struct.unpack_from("<I", p, 64 + 4 * i)
        body = (body + w * (2 * i + 1)) & 0xFFFFFFFFFFFFFFFF
    struct.pack_into("<Q", p, 48, body)
    h = 2166136261
    for b in p[:60]:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    struct.pack_into("<I", p, 60, h)


def mutate(rng: random.Random, payload: bytes) -> bytes:
    p = bytearray(payload)
    kind = rng.randrange(6)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            p[rng.randrange(len(p))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        p = p[: rng.randrange(len(p))]
    elif kind == 2:
        p += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == 3:
        # A header field set to an extreme value, checksums redone.
        offset = rng.choice([6, 7, 8, 9, 12, 16, 24, 32, 40])
        width = 1 if offset < 12 else (4 if offset == 12 else 8)
        value = rng.choice([0, 1, 2**(8 * width) - 1, rng.randrange(2**(8 * width))])
        p[offset:offset + width] = value.to_bytes(width, "little")
        reseal(p)
    elif kind == 4:
        start = rng.randrange(64, len(p)) if len(p) > 64 else 0
        for i in range(start, min(len(p), start + rng.randint(1, 32))):
            p[i] = rng.randrange(256)
        reseal(p)
    else:
        p = bytearray(rng.randrange(256) for _ in range(rng.randint(0, 300)))
    return bytes(p)


def payloads(rng: random.Random):
    for _ in range(8):
        n = rng.choice([1, 7, 64, 65, 1000])
        x = torch.randn(n).to(rng.choice([torch.float32, torch.float16, torch.bfloat16]))
        codec = gradcomp.Q4(block_size=rng.choice([16, 64, 256])) if rng.random() < 0.5 else gradcomp.TopK(
            ratio=rng.choice([0.01, 0.3, 1.0]))
        yield bytes(gradcomp.compress(x, codec).numpy())


def state_dicts(rng: random.Random, hook):
    for step in range(3):
        bucket = torch.randn(3001)
        hook._native.reduce_bucket(bucket, 0, [[3001]])
    yield hook.state_dict()


def mutate_state(rng: random.Random, sd: dict) -> dict:
    sd = copy.deepcopy(sd)
    key = rng.choice(list(sd))
    kind = rng.randrange(5)
    if kind == 0:
        sd.pop(key)
    elif kind == 1:
        sd[key] = rng.choice([None, -1, 2**70, "x", 1.5, [], {}, torch.zeros(3)])
    elif kind == 2 and sd["residuals"]:
        bucket = rng.choice(list(sd["residuals"]))
        t = sd["residuals"][bucket]
        sd["residuals"][bucket] = rng.choice([t[: rng.randrange(t.numel())], t.float(), t.view(1, -1),
                                              torch.cat([t, t]), t.flip(0)])
    elif kind == 3:
        sd["residuals"][rng.choice([-5, 2**65, "k", 7])] = torch.zeros(rng.randrange(64), dtype=torch.uint8)
    else:
        sd["layouts"] = {rng.randrange(2**64): rng.choice([{}, {"index": 0, "dtype": 9, "params": [[0, 1]]},
                                                           {"index": "a", "dtype": 0, "params": 5}])}
    return sd


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    failures = 0
    seeds = list(payloads(rng))
    for case in range(args.cases):
        data = mutate(rng, rng.choice(seeds))
        try:
            out = gradcomp.decompress(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                                      torch.zeros(0, dtype=torch.uint8))
            assert out.dim() == 1
        except ALLOWED:
            pass
        except BaseException as e:  # a wrong kind of error is a finding
            failures += 1
            print(f"payload case {case}: {type(e).__name__}: {e}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        hook = gradcomp.torch.Hook(_C.DdpHook(dist.group.WORLD, gradcomp.Q4()._options()), gradcomp.Q4())
        good = next(state_dicts(rng, hook))
        for case in range(args.cases // 6):
            try:
                hook.load_state_dict(mutate_state(rng, good))
            except ALLOWED:
                pass
            except BaseException as e:
                failures += 1
                print(f"state case {case}: {type(e).__name__}: {e}", file=sys.stderr)
        bucket = torch.randn(3001)
        hook.load_state_dict(good)  # still usable after everything it refused
        hook._native.reduce_bucket(bucket, 0, [[3001]])
        dist.destroy_process_group()
    print(f"fuzz_python: {args.cases} payload and {args.cases // 6} state cases, {failures} findings")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The second LM of bench/convergence.py (`--tasks lm2`, issue 36's "show it on both LMs"): its text, Python's own
standard-library source, and a GPT-style decoder with tied embeddings; see convergence.py's docstring."""
import math
import os
import sys

LM2_FILES = ("argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "difflib.py", "enum.py",
             "functools.py", "heapq.py", "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py",
             "pathlib.py", "random.py", "shutil.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py",
             "typing.py")
# What LM2_FILES hold on the interpreter the docs' numbers were measured with (docs/benchmarks.md).
LM2_CORPUS_PYTHON = (3, 11, 7)
LM2_CORPUS_BYTES = 1181126
LM2_CORPUS_SHA256 = "2179727c20e75fad77dfff8f863099808d94d619ee276ea2bf5d75bd5304462b"


def lm2_corpus_bytes():
    """The second LM's text: LM2_FILES of this interpreter's standard library, in that order, joined by a newline;
    and its sha256. On LM2_CORPUS_PYTHON the bytes must be the measured ones (raises otherwise)."""
    import hashlib
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in LM2_FILES:
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read())
    text = b"\n".join(parts)
    digest = hashlib.sha256(text).hexdigest()
    if sys.version_info[:3] == LM2_CORPUS_PYTHON and (len(text), digest) != (LM2_CORPUS_BYTES, LM2_CORPUS_SHA256):
        raise RuntimeError(f"lm2 corpus from {root}: {len(text)} bytes, sha256 {digest}; Python "
                           f"{'.'.join(map(str, LM2_CORPUS_PYTHON))} gave {LM2_CORPUS_BYTES} bytes, sha256 "
                           f"{LM2_CORPUS_SHA256}: not the text the docs measured")
    return text, digest


def lm2_corpus():
    """The second LM's bytes as int64 tokens < 256, train and held out (the last 5 %)."""
    import torch

    text, _ = lm2_corpus_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def make_lm2(seq, vocab=256, d=96, layers=6, heads=3):
    """A GPT-style decoder: pre-norm blocks (causal self-attention, GELU MLP), tied embeddings, GPT-2's init."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            b, t, _ = h.shape
            q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return h + self.out(F.gelu(self.fc(self.norm2(h))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    nn.init.zeros_(p)
                elif p.dim() == 2:  # residual projections scaled down by depth, as GPT-2
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, std=std)

        def forward(self, x):
            h = self.tok(x) + self.pos.weight[: x.shape[1]]
            for block in self.blocks:
                h = block(h)
            return F.linear(self.norm(h), self.tok.weight)  # the output head is the input embedding

    return GPT()


def lm2_optimizer(params, lr):
    import torch

    return torch.optim.AdamW(params, lr=lr or 3e-3, betas=(0.9, 0.95), weight_decay=0.1)

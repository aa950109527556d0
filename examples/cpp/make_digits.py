"""Writes scikit-learn's bundled digits as the binary file the C++ trainer reads.

    python examples/cpp/make_digits.py digits.bin

The split is the Python example's (examples/ddp_train.py): 80/20 with seed 0, features / 16.
Format: "DIGT", then uint32 train count, test count, features; float32 train features, int32
train labels, float32 test features, int32 test labels (little-endian).
"""
import struct
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits


def main(path: str) -> None:
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    with open(path, "wb") as f:
        f.write(b"DIGT")
        f.write(struct.pack("<III", len(train), len(test), x.shape[1]))
        for idx in (train, test):
            f.write(x[idx].numpy().astype("<f4").tobytes())
            f.write(y[idx].numpy().astype("<i4").tobytes())
    print(f"{path}: {len(train)} train, {len(test)} test, {x.shape[1]} features", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "digits.bin")

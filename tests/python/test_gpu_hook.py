"""GPU tests of the DDP hook (NCCL); reported as skipped where no CUDA device is present."""
import os
import subprocess
import sys

import pytest
import torch

import gradcomp
from launcher import launch

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                                reason="no CUDA device, or gradcomp built without CUDA")


@pytest.mark.parametrize("codec", ["q4", "q4_nearest", "topk"])
def test_cuda_hook_equals_cpu_hook_bit_for_bit(codec):
    assert all(launch("workers_gpu", "gpu_hook_matches_cpu", 1, codec))


def test_ddp_on_gpu_encodes_on_its_own_stream_overlapping_backward():
    assert all(launch("workers_gpu", "gpu_ddp_trains", 1))


_Q2_STANDALONE_ON_CUDA = """
import torch, gradcomp
x = torch.randn(100003)
q2 = gradcomp.Q2(seed=7)
cpu = gradcomp.compress(x, q2, step=2)
try:
    cuda = gradcomp.compress(x.cuda(), q2, step=2)
except RuntimeError as e:
    print("REFUSED", e)
    raise SystemExit(0)
assert torch.equal(cuda.cpu(), cpu), "CUDA q2 payload differs from the CPU reference"
assert torch.equal(gradcomp.decompress(cpu.cuda()).cpu(), gradcomp.decompress(cpu))
print("EQUAL")
"""


@pytest.mark.parametrize("kernels", ["v1", "v2"])
def test_standalone_q2_on_cuda_equals_the_cpu_under_v2_and_is_refused_under_v1(kernels):
    """gradcomp.compress / decompress with Q2 on a CUDA tensor: the v2 kernels (the process's, as Q4's
    standalone) give the CPU reference's bytes; under v1 the backend refuses Q2 naming the switch."""
    run = subprocess.run([sys.executable, "-c", _Q2_STANDALONE_ON_CUDA], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, GRADCOMP_KERNELS=kernels))
    assert run.returncode == 0, run.stderr[-3000:]
    if kernels == "v2":
        assert "EQUAL" in run.stdout, run.stdout + run.stderr[-3000:]
    else:
        assert "REFUSED" in run.stdout and "GRADCOMP_KERNELS=v2" in run.stdout, run.stdout

"""GPU tests of the DDP hook (NCCL); reported as skipped where no CUDA device is present."""
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

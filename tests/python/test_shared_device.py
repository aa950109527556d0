"""The hook on CUDA buckets with several ranks: processes sharing one GPU over Gloo, checked
against the CPU reference of the same bytes; the same bodies run on the CPU everywhere, so only
the device differs (the CUDA cases report as skipped without a GPU)."""
import pytest
import torch

import gradcomp

from launcher import launch

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                                                         reason="no CUDA device, or gradcomp built without CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_hook_on_device_equals_the_cpu_reference_bit_for_bit(device, world, codec):
    launch("workers_hook", "reference_equality", world, codec, 10007, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_hook_state_on_device_resumes_bit_for_bit(device, codec):
    assert all(launch("workers_hook", "state_round_trip", 2, codec, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_a_nan_on_one_rank_reaches_every_rank_on_device(device, codec):
    assert all(launch("workers_hook", "nan_propagates", 3, codec, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("world", [2, 3])
def test_both_routes_agree_on_device_and_skip_a_nan_step(device, amp, world):
    assert all(launch("workers_shared_device", "routes_agree_under_autocast", world, device, "q4", amp))

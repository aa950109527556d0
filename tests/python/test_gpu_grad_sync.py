"""GradSync on a GPU (NCCL, CUDA compression stream) through the C++ trainer; reported as
skipped where no CUDA device is present."""
import json

import pytest
import torch

import gradcomp

from cpp_trainer import digits_file, launch
from workers_grad_sync import check_against_reference

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                                reason="no CUDA device, or gradcomp built without CUDA")


@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_cuda_grad_sync_averages_as_the_reference_does(tmp_path, codec):
    data = digits_file(tmp_path)
    dump, layout_path = tmp_path / "grads", tmp_path / "layout.json"
    launch(1, ["--data", data, "--device", "cuda", "--codec", codec, "--steps", 3, "--dump", dump,
               "--layout-out", layout_path, "--bucket-cap-mb", 0.0001, "--first-bucket-cap-mb", 0.00002])
    check_against_reference(str(dump), json.loads(layout_path.read_text()), 1, 3, codec)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_cuda_grad_sync_on_a_shared_gpu_averages_as_the_reference_does(tmp_path, world, codec):
    # Several processes on one GPU over Gloo (NCCL refuses two ranks on one GPU).
    data = digits_file(tmp_path)
    dump, layout_path = tmp_path / "grads", tmp_path / "layout.json"
    launch(world, ["--data", data, "--device", "cuda", "--backend", "gloo", "--codec", codec, "--steps", 3,
                   "--dump", dump, "--layout-out", layout_path, "--bucket-cap-mb", 0.0001,
                   "--first-bucket-cap-mb", 0.00002])
    check_against_reference(str(dump), json.loads(layout_path.read_text()), world, 3, codec)


def test_cuda_grad_sync_trains_digits(tmp_path):
    ranks = launch(1, ["--data", digits_file(tmp_path), "--device", "cuda", "--codec", "q4", "--epochs", 10]).ranks
    assert ranks[0]["accuracy"] > 0.85, ranks

"""gradcomp.torch.fsdp: FSDP2's reduce-scatter compressed, on real Gloo process groups of CPU ranks,
checked bit for bit against the pure-PyTorch reference of the same payloads."""
import pytest
import torch

import gradcomp

from launcher import launch

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.skipif(not hasattr(getattr(fsdp_api, "FSDPModule", None), "set_custom_reduce_scatter"),
                                reason=f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("variant", ["avg", "premul", "accumulate", "nan"])
def test_fsdp_trains_like_the_reference_bit_for_bit(world, variant):
    assert all(launch("workers_fsdp", "trains_like_the_reference", world, variant))


@pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                    reason="no CUDA device, or gradcomp built without CUDA")
@pytest.mark.parametrize("variant", ["avg", "nan"])
@pytest.mark.parametrize("kernels", ["v1", "v2"])
def test_fsdp_on_cuda_trains_like_the_reference_bit_for_bit(variant, kernels, monkeypatch):
    """Two ranks sharing one GPU over Gloo (NCCL refuses two ranks on one GPU). Under v2 the q4
    reduce-scatter reports its verdicts late: the non-finite step is the run's last, so stats() must
    flush to count it."""
    monkeypatch.setenv("GRADCOMP_KERNELS", kernels)
    assert all(launch("workers_fsdp", "trains_like_the_reference", 2, variant, "cuda"))


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_mixed_precision_reduces_in_the_policy_dtype(reduce_dtype):
    assert all(launch("workers_fsdp", "mixed_precision_reaches_the_comm_in_the_reduce_dtype", 2, reduce_dtype))


def test_checkpoint_resumes_bit_for_bit_and_another_world_size_is_refused(tmp_path):
    path = str(tmp_path / "gradcomp_state")
    assert all(launch("workers_fsdp", "resumes_bit_for_bit", 2, path))
    assert all(launch("workers_fsdp", "refuses_another_world_size", 3, path))


def test_refusals_name_what_is_wrong():
    assert all(launch("workers_fsdp", "refuses_what_it_cannot_do", 2))


def test_topk_per_row_trains():
    assert all(launch("workers_fsdp", "topk_trains", 2))


def test_hsdp_compresses_the_allreduce_across_replicas_bit_for_bit():
    assert all(launch("workers_fsdp", "hsdp_trains_like_the_reference", 4))


def test_distributed_checkpoint_keeps_every_ranks_residuals(tmp_path):
    assert all(launch("workers_fsdp", "resumes_through_distributed_checkpoint", 2, str(tmp_path / "dcp")))


def test_fsdp_metrics_count_each_step_once_with_both_collectives():
    assert all(launch("workers_fsdp", "metrics_count_each_step_once", 4))

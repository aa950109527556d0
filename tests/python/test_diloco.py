"""gradcomp.torch.diloco: H inner steps per rank, then q4 outer gradients and an outer Nesterov SGD, on
real Gloo process groups, checked bit for bit against DiLoCo written out in plain PyTorch."""
import pytest
import torch

import gradcomp

from launcher import launch


@pytest.mark.parametrize("world", [2, 3, 4])
def test_diloco_equals_the_reference_bit_for_bit(world):
    """At W = 2 the worker also holds bench/diloco_fp32.py (the convergence runs' uncompressed baseline) to
    gradcomp's DiLoCo with a lossless codec, bit for bit."""
    stats = launch("workers_diloco", "trains_like_the_reference", world, "plain")
    assert all(s["rounds"] == 3 for s in stats), stats


def test_q2_outer_gradients_equal_the_reference_bit_for_bit():
    """gradcomp.Q2 reaches DiLoCo: two-phase q2 with error feedback, against reference.py's q2_encode."""
    stats = launch("workers_diloco", "trains_like_the_reference", 2, "q2")
    assert all(s["rounds"] == 3 for s in stats), stats


def test_q2_is_refused_by_the_per_step_front_ends_by_name():
    from gradcomp.ddp import _options
    from gradcomp.fsdp import FsdpHook
    for make in (lambda: _options(gradcomp.Q2()), lambda: FsdpHook(gradcomp.Q2())):
        with pytest.raises(ValueError, match="does not take gradcomp.Q2: Q2 is meant for DiLoCo"):
            make()
    with pytest.raises(ValueError, match="Q2 block_size"):
        gradcomp.Q2(block_size=48)


def test_q2_kernels_option_is_validated_and_handed_to_the_core():
    """Q2 takes Q4's kernels option (its CUDA kernels are v2 only); the core parses what the spec hands it."""
    with pytest.raises(ValueError, match="Q2 kernels must be one of 'default', 'v1', 'v2', got 'v3'"):
        gradcomp.Q2(kernels="v3")
    with pytest.raises(ValueError, match="Q2 kernels must be one of"):
        gradcomp.Q2(kernels=2)
    assert gradcomp.Q2()._options()["kernels"] == "default"
    assert gradcomp.Q2(kernels="v2")._options()["kernels"] == "v2"


def test_streaming_fragments_sync_staggered_and_equal_the_reference():
    stats = launch("workers_diloco", "trains_like_the_reference", 2, "fragments")
    assert all(s["rounds"] == 6 for s in stats), stats  # 2 fragments over 13 steps of H = 4


def test_overlap_tau_and_mixing_alpha_equal_the_streaming_reference():
    """Rounds in the background merged tau = 2 steps late with alpha = 0.5 (two fragments), and a state_dict
    taken mid-overlap, against workers_diloco.OverlapReference."""
    stats = launch("workers_diloco", "overlapped_trains_like_the_reference", 2)
    assert all(s["rounds"] == 6 for s in stats), stats


@pytest.mark.parametrize("world", [2, 3])
def test_eager_updates_equal_the_streaming_reference_extended_with_eager(world):
    """eager=True with tau = 2 over two fragments: each rank's own outer step at the sync point, corrected to the
    global step at the merge, against workers_diloco.OverlapReference(eager=True), bit for bit at every step, with
    a state_dict taken mid-overlap loaded back."""
    stats = launch("workers_diloco", "overlapped_trains_like_the_reference", world, True)
    assert all(s["rounds"] == 6 for s in stats), stats


def test_hierarchical_two_by_two_equals_the_reference():
    assert launch("workers_diloco", "trains_like_the_reference", 4, "hierarchical")


def test_a_diverged_rank_resets_every_rank_to_the_rounds_start():
    assert all(launch("workers_diloco", "nan_round_resets_every_rank", 2))


def test_distributed_checkpoint_keeps_every_ranks_state_and_resumes_bit_for_bit(tmp_path):
    """DiLoCo's state_dict is keyed by rank: torch.distributed.checkpoint at W = 2 saves both ranks' (differing)
    residuals and eager steps mid-overlap, and the resumed job equals the unbroken one bit for bit."""
    assert all(launch("workers_diloco", "resumes_through_distributed_checkpoint", 2, str(tmp_path / "dcp")))


def test_resume_bit_for_bit_and_refusals(tmp_path):
    path = str(tmp_path / "diloco")
    assert all(launch("workers_diloco", "resumes_bit_for_bit", 2, path))
    assert all(launch("workers_diloco", "refuses_what_it_cannot_do", 3, path))


@pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                    reason="no CUDA device, or gradcomp built without CUDA")
def test_diloco_on_cuda_equals_the_reference():
    """Two ranks sharing one GPU over Gloo; the reference's q4 runs on the CPU."""
    assert launch("workers_diloco", "trains_like_the_reference", 2, "plain", "cuda")


@pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                    reason="no CUDA device, or gradcomp built without CUDA")
def test_q2_on_cuda_with_the_v2_kernels_equals_the_reference():
    """gradcomp.Q2(kernels="v2") on a CUDA model: the v2 q2 kernels (Q2's only CUDA kernels) give the
    reference's outer gradients."""
    assert launch("workers_diloco", "trains_like_the_reference", 2, "q2-v2", "cuda")


@pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                    reason="no CUDA device, or gradcomp built without CUDA")
@pytest.mark.parametrize("eager", [False, True])
def test_overlap_on_cuda_with_the_v2_kernels_equals_the_reference(eager):
    """overlap_steps (tau) > 0 on a CUDA model: the outer step on the device (v2 kernels), the round on a
    thread of its own with the backend's stream current there; bit for bit the reference at every step."""
    stats = launch("workers_diloco", "overlapped_trains_like_the_reference", 2, eager, "cuda")
    assert all(s["rounds"] == 6 for s in stats), stats


def test_default_outer_settings_warn_on_short_or_unknown_runs_with_the_numbers():
    """diloco() with the papers' outer defaults warns, naming the measured losses, unless the outer settings are
    chosen or planned_steps says the run has >= 100 rounds; planned_steps never reaches the core."""
    import warnings
    from gradcomp.diloco import SHORT_RUN_MEASURED, _warn_if_short_run_defaults

    with pytest.warns(UserWarning, match="the run's length is unknown") as caught:
        _warn_if_short_run_defaults({"inner_steps": 20})
    assert SHORT_RUN_MEASURED in str(caught[0].message)
    options = {"inner_steps": 20, "planned_steps": 300}
    with pytest.warns(UserWarning, match=r"a run of 15 rounds \(300 steps at H = 20\)"):
        _warn_if_short_run_defaults(options)
    assert "planned_steps" not in options
    with pytest.warns(UserWarning, match="a run of 99 rounds"):
        _warn_if_short_run_defaults({"planned_steps": 9999})  # H = 100 by default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_short_run_defaults({"inner_steps": 20, "planned_steps": 2000})
        _warn_if_short_run_defaults({"inner_steps": 20, "outer_lr": 0.7})
        _warn_if_short_run_defaults({"inner_steps": 20, "outer_momentum": 0.9})
    with pytest.raises(ValueError, match="planned_steps must be an integer >= 1, got 0"):
        _warn_if_short_run_defaults({"planned_steps": 0})

"""The C++ training API (gradcomp::GradSync) through the example trainer: real processes under
torchrun --no-python, real Gloo."""
import json
import statistics

import numpy as np
import pytest
import torch

import gradcomp

from cpp_trainer import digits_file, launch, launch_quickstart
from launcher import launch as launch_python
from workers_grad_sync import check_against_reference

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return digits_file(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def accuracy(data):
    results = {}

    def run(codec):
        if codec not in results:
            per_seed = []
            for seed in SEEDS:
                ranks = launch(2, ["--data", data, "--codec", codec, "--seed", seed]).ranks
                assert ranks[0]["accuracy"] == ranks[1]["accuracy"], "ranks disagree on the trained model"
                per_seed.append(ranks[0]["accuracy"])
            results[codec] = statistics.mean(per_seed)
        return results[codec]

    return run


def test_the_documented_quickstart_runs_on_two_ranks(tmp_path):
    out = launch_quickstart(2, tmp_path)
    assert sum("bytes sent" in line for line in out.splitlines()) == 2, out
    assert (tmp_path / "quickstart.rank1.pt").exists()


def test_q4_trains_digits_as_well_as_uncompressed(accuracy):
    assert accuracy("q4") >= accuracy("none") - 0.01, (accuracy("q4"), accuracy("none"))
    assert accuracy("none") > 0.9


def test_uncompressed_grad_sync_equals_the_hand_written_allreduce_bit_for_bit(data, tmp_path):
    for codec in ("none", "allreduce"):
        launch(2, ["--data", data, "--codec", codec, "--epochs", 3, "--params-out", tmp_path / codec])
    for rank in range(2):
        a = np.fromfile(tmp_path / f"none.rank{rank}", dtype="<f4")
        b = np.fromfile(tmp_path / f"allreduce.rank{rank}", dtype="<f4")
        assert a.size > 0 and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_four_ranks_end_with_one_model_and_send_less(data, codec):
    ranks = launch(4, ["--data", data, "--codec", codec, "--epochs", 3]).ranks
    assert len({r["accuracy"] for r in ranks}) == 1
    assert 0 < ranks[0]["bytes_sent"] < ranks[0]["uncompressed_bytes"] / 4


@pytest.mark.parametrize("world,codec,accumulate,pieces", [
    (2, "q4", 1, 0), (3, "q4", 2, 0), (2, "topk", 1, 0), (3, "topk", 2, 0), (2, "topk-dgc", 1, 0),
    (3, "topk-q4warmup", 1, 0),
    # Pieces of 128 elements (the 2048-element layer's bucket in 16 per rank), against references
    # that reduce each bucket in one piece.
    (2, "q4", 1, 128), (3, "q4", 2, 128)])
def test_averaged_gradients_equal_the_reference_and_the_python_hook(data, tmp_path, world, codec, accumulate,
                                                                    pieces):
    steps = 3
    dump, layout_path = tmp_path / "grads", tmp_path / "layout.json"
    # Small buckets, so the model spreads over several; --accumulate adds no_sync micro-steps.
    launch(world, ["--data", data, "--codec", codec, "--steps", steps, "--dump", dump, "--layout-out",
                   layout_path, "--bucket-cap-mb", 0.0001, "--first-bucket-cap-mb", 0.00002,
                   "--accumulate", accumulate] + (["--piece-numel", pieces] if pieces else []))
    layout = json.loads(layout_path.read_text())
    assert len(layout["buckets"]) > 2, layout
    check_against_reference(str(dump), layout, world, steps, codec)
    assert all(launch_python("workers_grad_sync", "python_hook_matches", world, str(dump), layout, steps, codec))


@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_hierarchical_grad_sync_equals_the_hook_with_node_groups_and_resumes(data, tmp_path, codec):
    """Four ranks as two nodes of two: GradSync's buckets average to the bits of the DDP hook's
    core with the same node groups (itself checked against the three-step reference in
    test_hierarchical.py), less than all of its traffic leaves the node, and a checkpoint
    resumes bit-identically."""
    steps, world = 3, 4
    dump, layout_path = tmp_path / "grads", tmp_path / "layout.json"
    run = launch(world, ["--data", data, "--codec", codec, "--steps", steps, "--dump", dump, "--layout-out",
                         layout_path, "--bucket-cap-mb", 0.0001, "--first-bucket-cap-mb", 0.00002,
                         "--local-world-size", 2])
    assert all(0 < r["inter_node_bytes"] < r["bytes_sent"] for r in run.ranks), run.ranks
    layout = json.loads(layout_path.read_text())
    assert all(launch_python("workers_grad_sync", "python_hook_matches", world, str(dump), layout, steps, codec, 2))
    common = ["--data", data, "--codec", codec, "--steps", 12, "--local-world-size", 2]
    launch(world, common + ["--params-out", tmp_path / "uninterrupted"])
    launch(world, common + ["--save-at", 6, "--save", tmp_path / "ckpt", "--stop-at-save"])
    launch(world, common + ["--resume", tmp_path / "ckpt", "--params-out", tmp_path / "resumed"])
    for rank in range(world):
        a = np.fromfile(tmp_path / f"uninterrupted.rank{rank}", dtype="<f4")
        b = np.fromfile(tmp_path / f"resumed.rank{rank}", dtype="<f4")
        assert a.size > 0 and np.array_equal(a.view(np.int32), b.view(np.int32))
    flat = launch(world, ["--data", data, "--codec", codec, "--steps", 12, "--resume", tmp_path / "ckpt"], check=False)
    assert flat.returncode != 0 and "ranks per node" in flat.stderr + flat.stdout


# The CUDA cases: two processes sharing one GPU over Gloo (NCCL refuses two ranks on one GPU).
ON_CUDA = pytest.param(["--device", "cuda", "--backend", "gloo"], id="cuda",
                       marks=pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                                                reason="no CUDA device, or gradcomp built without CUDA"))
ON_CPU = pytest.param([], id="cpu")


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
@pytest.mark.parametrize("codec", ["q4", "topk", "topk-dgc", "topk-q4warmup"])
def test_resume_from_a_checkpoint_is_bit_identical(data, tmp_path, codec, device):
    # The q4 warm-up ends after the checkpoint (saved at 20) and before the end.
    common = ["--data", data, "--codec", codec, "--steps", 40] + (["--q4-warmup", 30] if "q4warmup" in codec else [])
    common += device
    launch(2, common + ["--params-out", tmp_path / "uninterrupted"])
    launch(2, common + ["--save-at", 20, "--save", tmp_path / "ckpt", "--stop-at-save"])
    launch(2, common + ["--resume", tmp_path / "ckpt", "--params-out", tmp_path / "resumed"])
    for rank in range(2):
        a = np.fromfile(tmp_path / f"uninterrupted.rank{rank}", dtype="<f4")
        b = np.fromfile(tmp_path / f"resumed.rank{rank}", dtype="<f4")
        assert a.size > 0 and np.array_equal(a.view(np.int32), b.view(np.int32))


def test_parameters_loaded_after_making_the_grad_sync_are_named_as_the_cause(data, tmp_path):
    run = launch(2, ["--data", data, "--steps", 3, "--reload-after-sync", tmp_path / "model"], timeout=120,
                 check=False)
    assert run.returncode != 0 and "new gradient accumulators" in run.stderr, run.stderr[-2000:]


def test_a_rank_with_another_model_gets_an_error_naming_the_ranks(data):
    run = launch(2, ["--data", data, "--steps", 3, "--hidden-on-rank", "1:33"], timeout=120, check=False)
    assert run.returncode != 0
    assert "rank 1 has" in run.stderr + run.stdout and "rank 0 has" in run.stderr + run.stdout, run.stderr[-2000:]


def test_unused_parameters_raise_by_name_or_count_as_zero(data):
    run = launch(2, ["--data", data, "--steps", 3, "--unused"], timeout=120, check=False)
    assert run.returncode != 0 and "'spare'" in run.stderr, run.stderr[-2000:]
    ranks = launch(2, ["--data", data, "--steps", 30, "--unused", "--find-unused"]).ranks
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]


@pytest.mark.parametrize("device", [ON_CPU, ON_CUDA])
def test_a_non_finite_bf16_step_is_reported_on_every_rank(data, device):
    run = launch(2, ["--data", data, "--steps", 5, "--dtype", "bfloat16", "--nan-at", 3] + device)
    reports = [line for line in run.lines if "nonfinite_buckets" in line and line.startswith("rank")]
    assert len(reports) == 2 and all(int(line.split()[-1]) >= 1 for line in reports), run.stdout


def test_the_worker_runs_where_asked_and_a_missing_cpu_is_refused(data):
    ranks = launch(2, ["--data", data, "--steps", 3, "--worker-cpus", "0"]).ranks
    assert [r["worker_cpus"] for r in ranks] == ["0", "0"], ranks
    run = launch(2, ["--data", data, "--steps", 3, "--worker-cpus", "1000"], timeout=120, check=False)
    assert run.returncode != 0
    assert "worker_cpus: CPU 1000 is not available to this process" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("world", [2, 3])
def test_cpp_diloco_trains_digits_resumes_bit_for_bit_and_sends_rounds_only(data, tmp_path, world):
    """gradcomp::DiLoCo in a C++ program: AdamW inner steps, q4 outer gradients every 10 steps (two
    staggered fragments); the ranks agree after the last round, reach dense-like accuracy, send only the
    rounds' bytes, and a run saved mid-round and resumed ends on the same bits."""
    common = ["--data", data, "--codec", "q4", "--optimizer", "adamw", "--lr", 0.003, "--diloco", 10,
              "--fragments", 2, "--steps", 300]
    run = launch(world, common + ["--params-out", tmp_path / "uninterrupted"])
    assert all(r["accuracy"] > 0.9 for r in run.ranks), run.ranks
    # bytes_sent counts what the communicator sent, each round's small agreement included (4.9x fewer
    # than the fp32 ring at W = 3 on this small model, where headers and the agreement weigh most).
    assert all(r["outer_rounds"] == 60 and 0 < r["bytes_sent"] < r["uncompressed_bytes"] / 4 for r in run.ranks), \
        run.ranks
    launch(world, common + ["--save-at", 155, "--save", tmp_path / "ckpt", "--stop-at-save"])
    launch(world, common + ["--resume", tmp_path / "ckpt", "--params-out", tmp_path / "resumed"])
    params = [np.fromfile(tmp_path / f"uninterrupted.rank{r}", dtype="<f4") for r in range(world)]
    for rank in range(world):
        b = np.fromfile(tmp_path / f"resumed.rank{rank}", dtype="<f4")
        assert params[rank].size > 0 and np.array_equal(params[rank].view(np.int32), b.view(np.int32))
    # Step 300 synced fragment 0 (t mod 10 = 0); fragment 1 last synced at step 295.
    assert all(np.array_equal(params[0][:100], p[:100]) for p in params)


def test_cpp_diloco_eager_updates_train_and_resume_bit_for_bit_with_a_round_in_flight(data, tmp_path):
    """gradcomp::DiLoCo with overlap_steps = 2 and eager updates: it trains, and a run saved after inner step
    155 (fragment 1 synced then, merging after 157: its mean and this rank's eager step in the checkpoint)
    and resumed ends on the bits of the unbroken run."""
    common = ["--data", data, "--codec", "q4", "--optimizer", "adamw", "--lr", 0.003, "--diloco", 10,
              "--fragments", 2, "--overlap-steps", 2, "--eager", "--steps", 300]
    run = launch(2, common + ["--params-out", tmp_path / "uninterrupted"])
    assert all(r["accuracy"] > 0.9 and r["outer_rounds"] == 60 for r in run.ranks), run.ranks
    launch(2, common + ["--save-at", 155, "--save", tmp_path / "ckpt", "--stop-at-save"])
    launch(2, common + ["--resume", tmp_path / "ckpt", "--params-out", tmp_path / "resumed"])
    for rank in range(2):
        a = np.fromfile(tmp_path / f"uninterrupted.rank{rank}", dtype="<f4")
        b = np.fromfile(tmp_path / f"resumed.rank{rank}", dtype="<f4")
        assert a.size > 0 and np.array_equal(a.view(np.int32), b.view(np.int32))


def test_cpp_diloco_warns_once_on_a_short_run_with_the_default_outer_settings(data):
    """gradcomp::DiLoCo with the papers' outer defaults and planned_steps giving 2 rounds warns once per rank
    with the core's numbers; chosen outer settings, or planned_steps of 100 rounds, keep it quiet."""
    common = ["--data", data, "--codec", "q4", "--optimizer", "adamw", "--lr", 0.003, "--diloco", 10]
    run = launch(2, common + ["--steps", 20])
    assert run.stderr.count("are kept for a run of 2 rounds (20 steps at H = 10)") == 2, run.stderr[-3000:]
    assert "+6.5 % loss above dense after 300 steps at H = 20" in run.stderr
    chosen = launch(2, common + ["--steps", 20, "--outer-lr", 1.0, "--outer-momentum", 0.3])
    assert "gradcomp DiLoCo: the default outer settings" not in chosen.stderr
    long = launch(2, ["--data", data, "--codec", "q4", "--diloco", 1, "--steps", 100])
    assert "gradcomp DiLoCo: the default outer settings" not in long.stderr


def test_cpp_check_optimizer_warns_for_topk_with_adamw(data):
    run = launch(2, ["--data", data, "--codec", "topk", "--optimizer", "adamw", "--lr", 0.003, "--steps", 3])
    assert "TopK with an adaptive optimizer" in run.stderr, run.stderr[-2000:]
    quiet = launch(2, ["--data", data, "--codec", "q4", "--optimizer", "adamw", "--lr", 0.003, "--steps", 3])
    assert "adaptive optimizer" not in quiet.stderr

"""Multi-process tests of the DDP hook over real Gloo process groups (CPU)."""
import os
import warnings

import pytest
import torch

import gradcomp
import gradcomp.torch as gt
from launcher import launch


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("codec", ["q4", "q4_nearest", "q4_pieces", "topk", "topk_dgc", "topk_dgc_nomask",
                                   "topk_q4warmup"])
def test_hook_equals_pure_pytorch_reference(world, codec):
    results = launch("workers_hook", "reference_equality", world, codec, 3001)
    sent, uncompressed = results[0]
    # The top-k warm-up's first steps send denser payloads; pieces of 128 elements per rank add a
    # 64-byte header to each.
    divisor = 2 if "dgc" in codec or "q4warmup" in codec else 3 if codec == "q4_pieces" else 4
    if world > 1:
        assert 0 < sent < uncompressed / divisor


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("codec", ["q4", "q4_pieces", "topk"])
def test_hook_equals_reference_at_larger_world_sizes(world, codec):
    results = launch("workers_hook", "reference_equality", world, codec, 3001, timeout=300)
    assert len(results) == world


@pytest.mark.parametrize("codec,route", [("q4", "register"), ("q4_pieces", "standard"), ("topk", "register"),
                                         ("topk_dgc", "standard"), ("topk_q4warmup", "register")])
def test_overlapped_buckets_train_the_same_weights_as_one_at_a_time(codec, route):
    overlapped = launch("workers_ddp", "overlapped_buckets_equal_one_at_a_time", 2, codec, route)
    # Overlap needs the next bucket queued when one is begun: not every time, but in 6 steps of 4+
    # buckets behind a wide layer's encode, at least once.
    assert sum(overlapped) > 0, overlapped


@pytest.mark.parametrize("route", ["register", "standard"])
def test_find_unused_parameters_trains_alike_on_every_rank(route):
    assert all(launch("workers_ddp", "find_unused_parameters_trains_alike_on_every_rank", 3, route))


def test_no_compression_equals_ddp_bit_for_bit():
    buckets = launch("workers_ddp", "no_compression_matches_ddp", 2)
    assert buckets[0] >= 20


@pytest.mark.parametrize("codec,dtype", [("q4", "float32"), ("topk", "float32"), ("q4", "bfloat16"),
                                         ("topk_dgc", "float32"), ("topk_q4warmup", "float32")])
def test_register_and_standard_route_agree(codec, dtype):
    stats = launch("workers_ddp", "routes_agree", 2, codec, dtype)
    # Against a ring allreduce of the bucket dtype: about 32 / 4.5 for fp32 and 16 / 4.5 for bf16
    # (top-k's warm-up sends denser payloads in its first steps).
    assert stats[0]["ratio"] > (2 if "dgc" in codec else 6 if dtype == "float32" else 3)


def test_momentum_correction_refuses_an_optimizer_with_its_own_momentum():
    params = [torch.nn.Parameter(torch.zeros(3))]
    dgc = gradcomp.TopK(momentum=0.9)
    gt.check_optimizer(torch.optim.SGD(params, lr=0.1), dgc)
    gt.check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), gradcomp.TopK())
    gt.check_optimizer(torch.optim.AdamW(params), gradcomp.Q4())
    with pytest.raises(ValueError, match="param group 0 has momentum=0.9"):
        gt.check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), dgc)
    with pytest.raises(ValueError, match="must be torch.optim.SGD with momentum=0, got AdamW"):
        gt.check_optimizer(torch.optim.AdamW(params), dgc)
    with pytest.raises(ValueError, match="momentum correction needs error_feedback"):
        gradcomp.TopK(momentum=0.9, error_feedback=False)
    with pytest.raises(ValueError, match="momentum must be in"):
        gradcomp.TopK(momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        gradcomp.TopK(clip_norm=float("nan"))
    with pytest.raises(ValueError, match="warmup must be 'sparsity' or 'q4', got 'dense'"):
        gradcomp.TopK(warmup="dense")
    with pytest.warns(UserWarning, match="TopK with an adaptive optimizer"):
        gt.check_optimizer(torch.optim.AdamW(params), gradcomp.TopK(warmup="q4", warmup_steps=10))


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW", "RMSprop", "Adagrad", "NAdam"])
def test_topk_with_an_adaptive_optimizer_warns_and_points_to_q4_or_diloco(optimizer):
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = getattr(torch.optim, optimizer)(params)
    with pytest.warns(UserWarning, match="Use Q4 .* or DiLoCo"):
        gt.check_optimizer(opt, gradcomp.TopK())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gt.check_optimizer(opt, gradcomp.Q4())
        gt.check_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), gradcomp.TopK())


@pytest.mark.parametrize("codec", ["q4", "topk", "topk_dgc", "topk_q4warmup"])
def test_checkpoint_resume_is_bit_identical(codec):
    assert all(launch("workers_hook", "checkpoint_resume", 2, codec))


@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_checkpoint_resume_is_bit_identical_when_ddp_rebuilds_buckets(codec):
    assert all(launch("workers_ddp", "checkpoint_resume_rebuilt_layout", 2, codec))


@pytest.mark.parametrize("route", ["register", "standard"])
def test_rebuilt_buckets_release_the_old_ones(route):
    assert all(launch("workers_ddp", "rebuilt_buckets_release_the_old_ones", 2, route))


@pytest.mark.parametrize("codec", ["q4", "topk"])
def test_nan_on_one_rank_reaches_all_and_keeps_residuals(codec):
    assert all(launch("workers_hook", "nan_propagates", 2, codec))


def test_layout_mismatch_names_the_ranks_quickly():
    elapsed = launch("workers_hook", "layout_mismatch", 3)
    assert max(elapsed) < 10


def test_no_sync_accumulation():
    launch("workers_ddp", "no_sync_accumulates", 2)


def test_codec_specs_validate_their_options():
    with pytest.raises(ValueError, match="block_size"):
        gradcomp.Q4(block_size=100)
    with pytest.raises(ValueError, match="rounding"):
        gradcomp.Q4(rounding="up")
    with pytest.raises(ValueError, match="ratio"):
        gradcomp.TopK(ratio=0)
    with pytest.raises(ValueError, match="value_dtype"):
        gradcomp.TopK(value_dtype=torch.int8)
    with pytest.raises(ValueError, match="seed"):
        gradcomp.Q4(seed=-1)
    with pytest.raises(ValueError, match=r"Q4 piece_numel must be an int in \[0, 2\*\*31\]"):
        gradcomp.Q4(piece_numel=-1)
    with pytest.raises(ValueError, match="TopK piece_numel must be an int .* got True"):
        gradcomp.TopK(piece_numel=True)
    with pytest.raises(ValueError, match="TopK piece_numel"):
        gradcomp.TopK(piece_numel=2**31 + 1)
    with pytest.raises(ValueError, match="Q4 kernels must be one of 'default', 'v1', 'v2', got 'v3'"):
        gradcomp.Q4(kernels="v3")
    with pytest.raises(ValueError, match="TopK kernels must be one of"):
        gradcomp.TopK(kernels=2)
    with pytest.raises(TypeError):
        gt.register(torch.nn.Linear(2, 2))


def test_kernel_generation_reaches_the_core_and_the_cpu_ignores_it():
    # The spec hands "kernels" to the core; on the CPU both generations give the same bytes.
    assert gradcomp.Q4(kernels="v2")._options()["kernels"] == "v2"
    x = torch.randn(1000)
    payloads = [gradcomp.compress(x, gradcomp.Q4(seed=3, kernels=k)) for k in ("v1", "v2", "default")]
    assert all(torch.equal(payloads[0], p) for p in payloads[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_standalone_compress_roundtrip(dtype):
    x = torch.randn(10007).to(dtype)
    payload = gradcomp.compress(x, gradcomp.Q4(rounding="nearest"))
    assert payload.dtype == torch.uint8 and payload.numel() < x.numel() * x.element_size() / 3
    y = gradcomp.decompress(payload)
    assert y.dtype == dtype and y.shape == (10007,)
    padded = torch.nn.functional.pad(x.float().abs(), (0, 10048 - 10007))
    step = (padded.reshape(-1, 64).amax(dim=1) / 7).repeat_interleave(64)[:10007]
    tolerance = 0.0 if dtype == torch.float32 else 2.0 ** -7  # rounding of the 16-bit output
    assert ((y.float() - x.float()).abs() <= step * 0.5 * (1 + 1e-5) + x.float().abs() * tolerance).all()
    t = gradcomp.decompress(gradcomp.compress(x, gradcomp.TopK(ratio=0.1)))
    assert int(t.count_nonzero()) == 1001
    kept = t != 0
    assert torch.equal(t[kept], x[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_standalone_q2_compress_roundtrip(dtype):
    """gradcomp.compress(x, Q2()) through the core's CPU codec: 2-bit codes, four levels (c - 1.5) d per block of
    64, d the smallest bfloat16 step with 1.5 d >= the block's largest |x|; about half of q4's bytes."""
    x = torch.randn(10007).to(dtype)
    payload = gradcomp.compress(x, gradcomp.Q2(rounding="nearest"))
    q4 = gradcomp.compress(x, gradcomp.Q4(rounding="nearest"))
    assert payload.dtype == torch.uint8 and payload.numel() < 0.55 * q4.numel()
    y = gradcomp.decompress(payload)
    assert y.dtype == dtype and y.shape == (10007,)
    blocks = torch.nn.functional.pad(x.float().abs(), (0, 10048 - 10007)).reshape(-1, 64).amax(dim=1)
    step = (blocks / 1.5 * (1 + 2.0 ** -7)).repeat_interleave(64)[:10007]  # d rounds A / 1.5 up to bf16
    tolerance = 0.0 if dtype == torch.float32 else 2.0 ** -7  # rounding of the 16-bit output
    assert ((y.float() - x.float()).abs() <= step * 0.5 * (1 + 1e-5) + x.float().abs() * tolerance).all()
    if dtype == torch.float32:
        levels = torch.nn.functional.pad(y, (0, 10048 - 10007), value=float(y[-1])).reshape(-1, 64)
        assert all(torch.unique(row).numel() <= 4 for row in levels)
    # Stochastic rounding: reproducible per (seed, step), unbiased over seeds.
    q2 = gradcomp.Q2(seed=5)
    assert torch.equal(gradcomp.compress(x, q2, step=3), gradcomp.compress(x, q2, step=3))
    assert not torch.equal(gradcomp.compress(x, q2, step=3), gradcomp.compress(x, q2, step=4))
    if dtype == torch.float32:
        mean = torch.stack([gradcomp.decompress(gradcomp.compress(x, gradcomp.Q2(seed=s))) for s in range(400)]).mean(0)
        # each decode errs by at most d with variance <= d^2 / 4: the mean's deviation <= d / 40 (s.d.)
        assert ((mean - x).abs() <= step / 40 * 6).all()


def test_decompress_refuses_corrupt_q2_payloads_by_name():
    payload = gradcomp.compress(torch.randn(1000), gradcomp.Q2())
    bad = payload.clone()
    bad[-5] ^= 1
    with pytest.raises(RuntimeError, match=r"q2 decode: payload 0 \(from rank 0\) rejected: body checksum"):
        gradcomp.decompress(bad)
    with pytest.raises(RuntimeError, match="shorter than the 64-byte header"):
        gradcomp.decompress(payload[:30])
    with pytest.raises(RuntimeError, match="payload shorter than its header says"):
        gradcomp.decompress(payload[:-16])
    with pytest.raises(ValueError, match="Q2 block_size"):
        gradcomp.compress(torch.randn(8), gradcomp.Q2(block_size=48))


def test_decompress_rejects_corrupt_payloads():
    payload = gradcomp.compress(torch.randn(1000), gradcomp.TopK(ratio=0.05))
    bad = payload.clone()
    bad[20] ^= 1
    with pytest.raises(RuntimeError, match="checksum"):
        gradcomp.decompress(bad)
    with pytest.raises(RuntimeError, match="shorter"):
        gradcomp.decompress(payload[:30])
    # A changed body fails its checksum before any index is used; an index out of range behind
    # a valid checksum is refused too (tests/codec/test_topk.cpp, TopKCorruption).
    idx = payload[64:64 + 4 * 50].view(torch.int32)
    idx[3] = 5000
    with pytest.raises(RuntimeError, match="body checksum"):
        gradcomp.decompress(payload)


@pytest.mark.parametrize("option", ["gradient_as_bucket_view", "static_graph"])
def test_ddp_options(option):
    assert all(launch("workers_ddp", "ddp_options_agree", 2, option))


def test_grad_scaler_skips_the_step_on_every_rank():
    assert all(launch("workers_ddp", "grad_scaler_skips_on_every_rank", 2))


def test_profiler_shows_every_phase():
    assert all(launch("workers_ddp", "profiler_sees_phases", 2))


@pytest.mark.parametrize("route", ["register", "standard"])
def test_the_worker_runs_on_the_cpus_asked_for(route):
    for cpus, placement, _ in launch("workers_ddp", "worker_cpus_placement", 2, route, [0]):
        assert cpus == [0] and placement == "CPUs 0, as asked", (cpus, placement)
    # By default (no OpenMP binding here) the worker keeps the CPUs of the thread running backward.
    for cpus, placement, backward_cpus in launch("workers_ddp", "worker_cpus_placement", 2, route, "auto"):
        assert cpus == backward_cpus and placement.startswith("inherited"), (cpus, placement)


def test_under_openmp_binding_auto_lets_the_worker_off_backwards_core(monkeypatch):
    """OMP_PROC_BIND binds the thread that starts OpenMP (the one running backward) to one core,
    and every thread it starts would inherit that; the hook's worker may also use the free cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else OpenMP binds a compute thread to every core
    # OpenMP reads these when torch loads it: fresh interpreters, not the fork server's.
    for cpus, placement, backward_cpus in launch("workers_ddp", "worker_cpus_placement", 2, "register", "auto",
                                                 start="spawn"):
        assert len(backward_cpus) == 1, backward_cpus  # OpenMP bound it
        assert len(cpus) > 1 and backward_cpus[0] in cpus, (cpus, placement)
        assert "OpenMP bound the binding thread" in placement, placement
    for cpus, _, backward_cpus in launch("workers_ddp", "worker_cpus_placement", 2, "standard", "inherit",
                                         start="spawn"):
        assert cpus == backward_cpus, (cpus, backward_cpus)


@pytest.mark.parametrize("bad", [[], [-1], ["0"], 1.5, True, "two", "0-", ""])
def test_bad_worker_cpus_are_refused_by_register_and_hook_state(bad):
    with pytest.raises(ValueError, match="worker_cpus"):
        gt.HookState(gradcomp.Q4(), worker_cpus=bad)

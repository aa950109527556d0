"""gradcomp.torch.fsdp(..., params=gradcomp.Int8()): FSDP2's parameter all-gathers as int8 on real Gloo
process groups of CPU ranks, checked bit for bit against the pure-PyTorch reference."""
import re

import pytest
import torch

import gradcomp
import gradcomp.torch as gt

from launcher import launch

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
has_hook = hasattr(getattr(fsdp_api, "FSDPModule", None), "set_custom_all_gather")


@pytest.mark.skipif(not has_hook, reason=f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather")
@pytest.mark.parametrize("world, cases", [
    (2, ["fp32", "bf16", "two_dtypes", "reshard_false", "train", "metrics", "int4_fp32", "int4_bf16",
         "int4_reshard_false", "nan"]),
    (3, ["fp32", "bf16", "cpp_api", "int4_fp32"]),
    (4, ["fp32", "reshard_int", "hsdp", "int4_reshard_int", "int4_hsdp"]),
])
def test_int8_all_gather_is_the_reference_bit_for_bit(world, cases):
    results = launch("workers_fsdp_params", "int8_all_gather_cases", world, cases)
    assert len(results) == world
    if "nan" in cases:  # every rank refused, with the same message but for its own rank and
        # where in its own shard the non-finite value sits (only the ranks holding one say that)
        local = re.compile(r"; this rank's first is element \d+ of run \d+ \(\w+, element \d+ of its shard\)")
        assert any(local.search(r[-1]) for r in results), [r[-1] for r in results]
        messages = {local.sub("", r[-1]).replace(f"on rank {rank}", "on rank R") for rank, r in enumerate(results)}
        assert len(messages) == 1, messages
        print(messages.pop())


@pytest.mark.skipif(not has_hook, reason=f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather")
def test_a_dcp_checkpoint_with_int8_or_int4_weights_round_trips_and_resumes_bit_for_bit(tmp_path):
    assert all(launch("workers_fsdp_params", "resumes_with_quantized_weights_through_distributed_checkpoint", 2,
                      str(tmp_path / "dcp")))


@pytest.mark.skipif(not (torch.cuda.is_available() and gradcomp.with_cuda),
                    reason="no CUDA device, or gradcomp built without CUDA")
@pytest.mark.parametrize("kernels", ["v1", "v2"])
def test_cpp_api_on_cuda_is_the_reference_bit_for_bit(kernels, monkeypatch):
    """gradcomp::WeightAllGather's CUDA path (FSDP's, v2 only), then the front end's collective with the 4-bit
    codec on CUDA (v2 only): two ranks sharing one GPU over Gloo, in one launch."""
    monkeypatch.setenv("GRADCOMP_KERNELS", kernels)
    want = ["refused", "int4 refused"] if kernels == "v1" else ["cuda", "int4 cuda"]
    assert launch("workers_fsdp_params", "int8_all_gather_cases", 2, ["cpp_api_cuda", "int4_cuda"]) == [want, want]


def test_a_torch_without_set_custom_all_gather_is_refused_by_name(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    if has_hook:
        monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    with pytest.raises(RuntimeError, match=r"set_custom_all_gather, which torch .* lacks \(it came in torch 2.9\)"):
        gt.fsdp(torch.nn.Linear(2, 2), gradcomp.Q4(), params=gradcomp.Int8())


def test_bad_params_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        gradcomp.Int8(block_size=48)
    with pytest.raises(ValueError, match="Int4 block_size must be a power of two"):
        gradcomp.Int4(block_size=8)
    assert gradcomp.Int4()._options() == {"codec": "int4", "block_size": 32}
    if has_hook:
        with pytest.raises(ValueError, match="params takes gradcomp.Int8"):
            gt.fsdp(torch.nn.Linear(2, 2), gradcomp.Q4(), params=gradcomp.Q4())



def test_cuda_parameters_need_the_v2_kernels(monkeypatch):
    """On CUDA the weight all-gathers' kernels (int8 and 4-bit) are v2 only: under v1 the install refuses naming
    the switch, under GRADCOMP_KERNELS=v2 it accepts (a stand-in parameter on cuda:0, so this runs without a GPU)."""
    from gradcomp import fsdp as gf

    class OnCuda:
        device = torch.device("cuda", 0)

    class Module:
        def parameters(self):
            return [OnCuda()]

    m = Module()
    monkeypatch.delenv("GRADCOMP_KERNELS", raising=False)
    with pytest.raises(ValueError, match=r"module 'blocks.0' has parameters on cuda:0; .*GRADCOMP_KERNELS=v2"):
        gf._check_plain_parameters([m], {m: "module 'blocks.0'"})
    monkeypatch.setenv("GRADCOMP_KERNELS", "v1")
    with pytest.raises(ValueError, match="GRADCOMP_KERNELS=v2"):
        gf._check_plain_parameters([m], {m: "module 'blocks.0'"})
    monkeypatch.setenv("GRADCOMP_KERNELS", "v2")
    gf._check_plain_parameters([m], {m: "module 'blocks.0'"})
    gf._check_plain_parameters([m], {m: "module 'blocks.0'"}, int4=True)  # 4-bit: v2 kernels too
    monkeypatch.setenv("GRADCOMP_KERNELS", "v1")
    with pytest.raises(ValueError, match=r"Int4\(\)\): module 'blocks.0' has parameters on cuda:0; "
                                         r".*GRADCOMP_KERNELS=v2"):
        gf._check_plain_parameters([m], {m: "module 'blocks.0'"}, int4=True)

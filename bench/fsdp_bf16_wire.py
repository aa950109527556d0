"""FSDP2 bf16 mixed precision's traffic with fp32 compute: the `fsdp-bf16-mp` baseline of bench/e2e.py.

Users run FSDP with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)``:
the weights are all-gathered in bf16 and the gradients reduce-scattered in bf16, half of fp32's bytes
each way. On a GPU the forward and backward then also run in bf16, faster than fp32. This benchmark's
CPU has no bf16 arithmetic (the benchmark's 32 x 1024 by 1024 x 1024 matmul: 291 ms in bf16 against
4.8 ms in fp32, one thread, 2026-12-06), so timing the real policy would measure the CPU's emulation,
not the network. These comms put exactly the policy's
bf16 bytes on the wire and keep the compute in fp32: each rank's shard is rounded to bf16, all-gathered
in bf16 and widened into FSDP's fp32 buffer (every rank computes with the bf16-rounded weights, as under
the policy); the fp32 gradients are rounded to bf16, reduce-scattered in bf16 and widened into the fp32
shard. The step time is therefore the policy's communication with fp32's compute: a stand-in for the
GPU case, where bf16 compute would be faster still for every FSDP method alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from gradcomp._torch_compat import fsdp_all_gather_api, fsdp_reduce_scatter_api
from gradcomp.fsdp import _divisor


def _comm_classes():
    AllGather = fsdp_all_gather_api()
    _, ReduceScatter = fsdp_reduce_scatter_api()

    class Bf16WireAllGather(AllGather):
        """FSDP's parameter all-gather with bf16 on the wire into FSDP's fp32 output."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            wire = torch.empty(output_tensor.numel(), dtype=torch.bfloat16, device=output_tensor.device)
            dist.all_gather_into_tensor(wire, input_tensor.to(torch.bfloat16), group=group)
            output_tensor.copy_(wire)
            return None

    class Bf16WireReduceScatter(ReduceScatter):
        """FSDP's gradient reduce-scatter with bf16 on the wire into FSDP's fp32 shard."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            wire = torch.empty(output_tensor.numel(), dtype=torch.bfloat16, device=output_tensor.device)
            # Summed in bf16 as reduce_dtype=bf16 sums, then divided as FSDP's op asks (Gloo has no AVG).
            dist.reduce_scatter_tensor(wire, input_tensor.to(torch.bfloat16), op=dist.ReduceOp.SUM, group=group)
            output_tensor.copy_(wire).div_(_divisor(op, group.size()))
            return None

    return Bf16WireAllGather, Bf16WireReduceScatter


def install_bf16_wire(model: nn.Module) -> int:
    """Sets both comms on every ``fully_shard`` module of ``model``; returns how many modules."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = _comm_classes()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_custom_all_gather(all_gather())
        m.set_custom_reduce_scatter(reduce_scatter())
    return len(modules)


def bf16_replica_allreduce(shard: torch.Tensor, group) -> None:
    """HSDP's all-reduce of a reduced gradient shard across replicas in bf16 (reduce_dtype=bf16), in
    place: the mean over the replicas, widened back into the fp32 shard."""
    wire = shard.to(torch.bfloat16)
    dist.all_reduce(wire, group=group)
    shard.copy_(wire).div_(group.size())

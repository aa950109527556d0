"""A plain-PyTorch 4-bit weight all-gather for FSDP2: measures what 4-bit weights cost in loss before the core has one.

Block-scaled round-to-nearest: per block of B elements, scale = max |x| / 7 in fp32 rounded up to bf16 (the smallest
positive bf16 when that quotient underflows; 0 for a block of zeros), codes x / scale rounded half to even in [-7, 7],
decoded as code * scale. These are gradcomp.Int8's rules (docs/format.md, GCW8) with 7 in place of 127; blocks restart
at every dtype run of FSDP's all-gather row, as Int8's do. It sits where gradcomp's int8 all-gather decodes: a
``set_custom_all_gather`` comm over each module's shard group that gathers the exact shards and rounds every rank's
row, its own included, so every rank computes with the same weights and the optimizer's sharded parameters stay
exact. The wire carries the exact shards (this measures loss, not bytes).
"""
import torch
import torch.distributed as dist

Q4_WEIGHT_MAX_CODE = 7


def q4_weight_roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """A 1-D float tensor through block-scaled 4-bit round-to-nearest, decoded back into its dtype."""
    f = x.float()
    n = f.numel()
    blocks = torch.cat([f, f.new_zeros(-n % block)]).view(-1, block)
    absmax = blocks.abs().amax(1)
    if not torch.isfinite(absmax).all():
        raise ValueError("4-bit weight all-gather: a non-finite weight")
    bits = (absmax / float(Q4_WEIGHT_MAX_CODE)).view(torch.int32)
    bits = torch.where(bits & 0xFFFF != 0, bits + 0x10000, bits) & -0x10000  # rounded up to bf16
    bits = torch.where((bits == 0) & (absmax > 0), torch.full_like(bits, 0x10000), bits)
    scale = bits.view(torch.float32)[:, None]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks))
    codes = codes.clamp(-Q4_WEIGHT_MAX_CODE, Q4_WEIGHT_MAX_CODE)
    return (codes * scale + 0.0).reshape(-1)[:n].to(x.dtype)  # + 0.0: a code 0 decodes to +0


def install(model, block: int) -> int:
    """Sets the 4-bit all-gather on every ``fully_shard`` module of ``model`` with parameters; returns how many."""
    from torch.distributed.fsdp import FSDPModule

    from gradcomp._torch_compat import fsdp_all_gather_api, fsdp_param_group
    from gradcomp.fsdp import _runs_of

    AllGather = fsdp_all_gather_api()

    class Q4WeightAllGather(AllGather):
        def __init__(self, name, param_group):
            self._name, self._param_group = name, param_group
            self._shard_group = param_group.mesh_info.shard_process_group

        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            if group is not self._shard_group:  # reshard_after_forward=<int>: already-rounded weights
                return None
            runs = _runs_of(self._param_group, input_tensor, self._name)
            for row in output_tensor.view(group.size(), -1):
                if input_tensor.dtype != torch.uint8:
                    row.copy_(q4_weight_roundtrip(row, block))
                    continue
                at = 0
                for dtype_name, numel in runs:
                    dtype = getattr(torch, dtype_name)
                    size = numel * torch.empty(0, dtype=dtype).element_size()
                    part = row[at:at + size].view(dtype)
                    part.copy_(q4_weight_roundtrip(part, block))
                    at += size
            return None

    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = fsdp_param_group(module)
            if group is not None:
                module.set_custom_all_gather(Q4WeightAllGather(name or "the root module", group))
                count += 1
    return count

"""The FP8 DDP communication hook training frameworks ship in 2026 (LoongForge's ~40 lines; VeOmni's
FSDP2 reduce-scatter does the same), as the end-to-end benchmark's baseline: each bucket quantized to
e4m3 with one scale per block of 128, an all-to-all of the chunks, an fp32 sum of one's own chunk,
the sum re-quantized, an allgather. No error feedback (they keep none). Written here from that
description; it shares no code with gradcomp.

    ddp.register_comm_hook(None, fp8_hook)
"""
import torch
import torch.distributed as dist

BLOCK = 128
E4M3_MAX = 448.0


def _quantize(x: torch.Tensor):
    """fp32 (n_blocks, BLOCK) -> e4m3 codes as uint8 and one fp32 scale per block."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
    codes = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * scale


def fp8_allreduce_mean(flat: torch.Tensor, group=None) -> torch.Tensor:
    """The mean of `flat` over the group through FP8 all-to-all + fp32 sum + FP8 allgather."""
    world = dist.get_world_size(group)
    n = flat.numel()
    blocks_per_rank = -(-n // (world * BLOCK))
    padded = torch.zeros(world * blocks_per_rank * BLOCK, dtype=torch.float32, device=flat.device)
    padded[:n] = flat.float()
    codes, scale = _quantize(padded.view(-1, BLOCK))
    recv_codes, recv_scale = torch.empty_like(codes), torch.empty_like(scale)
    dist.all_to_all_single(recv_codes, codes, group=group)
    dist.all_to_all_single(recv_scale, scale, group=group)
    own = _dequantize(recv_codes, recv_scale).view(world, blocks_per_rank, BLOCK).sum(dim=0) / world
    own_codes, own_scale = _quantize(own)
    all_codes = torch.empty((world * blocks_per_rank, BLOCK), dtype=torch.uint8, device=flat.device)
    all_scale = torch.empty((world * blocks_per_rank, 1), dtype=torch.float32, device=flat.device)
    dist.all_gather_into_tensor(all_codes, own_codes, group=group)
    dist.all_gather_into_tensor(all_scale, own_scale, group=group)
    return _dequantize(all_codes, all_scale).view(-1)[:n].to(flat.dtype)


def fp8_hook(process_group, bucket):
    """DDP communication hook: the bucket averaged through FP8 (blocking, as the frameworks' hooks)."""
    buffer = bucket.buffer()
    buffer.copy_(fp8_allreduce_mean(buffer, process_group))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future

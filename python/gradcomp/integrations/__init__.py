"""gradcomp inside Lightning, Hugging Face Accelerate and the Trainer: what the adapters share (docs/integrations.md).

The adapters (``gradcomp.integrations.lightning``, ``.accelerate``, ``.transformers``) import their
framework; this module imports none, so ``import gradcomp`` never needs them.
"""
import io

import torch
import torch.distributed as dist

from .. import ddp

__all__ = ["attach", "check_ran", "gather_state", "rank_state", "log_values"]


def attach(model, codec, *, optimizer=None, where: str, wrap_hint: str, **register_kwargs) -> "ddp.Hook":
    """``gradcomp.torch.register`` on the framework's wrapped model, with its misuse errors phrased
    for the framework: ``where`` names the adapter, ``wrap_hint`` says where the model gets wrapped."""
    try:
        inner = ddp._ddp_module(model)
    except TypeError:
        raise TypeError(f"{where}: gradcomp compresses DistributedDataParallel's gradient buckets, but the model "
                        f"is a {type(model).__name__} (not wrapped in DDP yet, or another strategy). {wrap_hint}") from None
    if getattr(inner, "_gradcomp_hook", None) is not None:
        raise RuntimeError(f"{where}: gradcomp is already registered on this model (DDP takes one communication hook); "
                           f"register it once, through one adapter or gradcomp.torch.register")
    if inner._comm_hooks:  # a Python hook registered by register_comm_hook (e.g. DDPStrategy(ddp_comm_hook=...))
        raise RuntimeError(f"{where}: the model already has the communication hook "
                           f"{inner._comm_hooks[0][0].__qualname__} (DDP takes one); drop it (for Lightning: "
                           f"DDPStrategy's ddp_comm_hook/ddp_comm_state) or drop gradcomp's adapter")
    hook = ddp.register(inner, codec, optimizer=optimizer, **register_kwargs)
    inner._gradcomp_hook = hook
    return hook


def check_ran(hook, where: str) -> None:
    """Raises when the optimizer has stepped and gradcomp's hook has not: a run the user asked to compress is
    running uncompressed (the step counter of gradcomp's engine stays at 0)."""
    if hook.stats()["total"]["steps"] == 0:
        raise RuntimeError(f"{where}: the optimizer stepped but gradcomp's hook never ran, so this step's gradients "
                           f"were not averaged by gradcomp. The model that runs backward must be the DDP model gradcomp "
                           f"was registered on (not the module inside it), and DDP's C++ reducer must run (no "
                           f"optimize_ddp='python_reducer', no compiled autograd)")


def log_values(hook) -> dict:
    """gradcomp's bytes per step and ratio (to fp32 ring allreduce) for a framework's logger."""
    step = hook.stats()["step"]
    return {"gradcomp/bytes_per_step": float(step["bytes_sent"]), "gradcomp/ratio": float(step["ratio"])}


def _device():
    # NCCL moves CUDA tensors only; Gloo moves CPU tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_state(hook) -> dict:
    """Every rank's ``hook.state_dict()`` (each rank's residuals differ) for a checkpoint that one rank
    writes (Lightning's, Accelerate's). Each state travels as ``torch.save`` bytes in a uint8 tensor, so
    a checkpoint holds tensors only and ``rank_state`` reads them back with ``weights_only=True``.
    A collective over the default group: every rank calls it, on its main thread, when the
    framework saves (Lightning and Accelerate build the checkpoint on every rank)."""
    buf = io.BytesIO()
    torch.save(hook.state_dict(), buf)
    mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(_device())
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=mine.device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=mine.device)
    padded[:mine.numel()] = mine
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return {"format": 1, "world_size": world, "ranks": [o[:int(s.item())].cpu() for o, s in zip(out, sizes)]}


def rank_state(saved: dict, where: str) -> dict:
    """This rank's hook state from ``gather_state``'s dict, refusing one saved by another world size."""
    if not isinstance(saved, dict) or saved.get("format") != 1 or not isinstance(saved.get("ranks"), list):
        raise ValueError(f"{where}: the checkpoint's gradcomp entry is not one gradcomp wrote")
    world, rank = dist.get_world_size(), dist.get_rank()
    if saved["world_size"] != world or len(saved["ranks"]) != world:
        raise ValueError(f"{where}: the checkpoint holds gradcomp state for {saved['world_size']} ranks, this job "
                         f"has {world}: resume with the same world size (or start gradcomp afresh without it)")
    data = saved["ranks"][rank]
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8:
        raise ValueError(f"{where}: the checkpoint's gradcomp state for rank {rank} is not a uint8 tensor")
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

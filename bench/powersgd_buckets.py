"""PowerSGD (PyTorch's hook) with DDP's normal buckets on Gloo: a process group per bucket index.

PyTorch's PowerSGD hook issues its P and Q allreduces from future callbacks, which on Gloo run on the
process group's worker threads; with several buckets the ranks' collective order then diverges and Gloo
aborts (docs/benchmarks.md). With its own process group per bucket index, each group sees one bucket's
collectives, in order, on every rank, and communication still overlaps backward. Each bucket's state
counts the steps itself, since PyTorch's state advances only on the last bucket.
"""
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook


def register_powersgd_per_bucket(ddp, rank=4, start_iter=2):
    # A bucket holds at least one parameter, and closes once it passes DDP's cap (the first one a
    # smaller cap): at most one more bucket than caps the gradients fill, plus the first.
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in params)
    count = min(len(params), 2 + -(-total // ddp.bucket_bytes_cap))
    states = [powerSGD_hook.PowerSGDState(process_group=dist.new_group(), matrix_approximation_rank=rank,
                                          start_powerSGD_iter=start_iter, use_error_feedback=True, warm_start=True)
              for _ in range(count)]
    steps = [0]

    def hook(_, bucket):
        state = states[bucket.index()]
        state.iter = max(state.iter, steps[0])
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        if bucket.is_last():
            steps[0] += 1
        return future

    ddp.register_comm_hook(None, hook)
    return states

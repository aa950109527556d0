"""A DDP job with gradcomp that checkpoints every N steps and resumes from its last checkpoint,
for the elastic-restart test: run under torchrun --max-restarts=1, one rank kills itself at a
given step of the first attempt, and the restarted job must end with the parameters of a run
that never stopped.

    torchrun --nproc-per-node 2 --max-restarts 1 elastic_train.py --codec q4 --steps 30 \\
        --every 5 --dir CKPT --out PARAMS [--kill-rank 1 --kill-step 17]
"""
import argparse
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp.torch as gt

from workers_common import UsedInReverse, codec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="q4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A store prefix per attempt: with torch 2.15's plain env:// init, the restarted ranks read
    # the first attempt's Gloo addresses from torchrun's store and fail to connect, or hang.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    torch.manual_seed(0)
    # Layers registered in the reverse of their use: after a restart DDP first presents other
    # buckets than the checkpoint's, which the hook must map back.
    ddp = nn.parallel.DistributedDataParallel(UsedInReverse(), bucket_cap_mb=0.004)
    hook = gt.register(ddp, codec(args.codec))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(args.dir, f"rank{rank}.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        hook.load_state_dict(state["gradcomp"])
        start = state["step"]
    for step in range(start, args.steps):
        if step % args.every == 0 and step > start:
            tmp = path + ".tmp"
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "gradcomp": hook.state_dict(), "step": step}, tmp)
            os.replace(tmp, path)  # a rank killed while saving leaves the previous checkpoint
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    params = torch.cat([q.detach().reshape(-1) for q in ddp.module.parameters()])
    np.save(f"{args.out}.rank{rank}.npy", params.numpy())
    print(f"rank {rank} attempt {attempt} finished from step {start}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

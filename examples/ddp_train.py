"""Data-parallel training of an MLP on scikit-learn's digits with gradcomp as the DDP comm hook.

    torchrun --nproc-per-node 2 examples/ddp_train.py --codec q4
    torchrun --nproc-per-node 2 examples/ddp_train.py --codec topk --ratio 0.01
    torchrun --nproc-per-node 2 examples/ddp_train.py --codec none        # plain DDP allreduce
    srun --ntasks-per-node 2 python examples/ddp_train.py --codec q4      # Slurm, without torchrun
    examples/launch/: the same under torchrun (one node, several), sbatch and Kubernetes

Runs on CPU with Gloo, or on GPUs with NCCL (one GPU per process) when CUDA is available.
"""
import argparse
import hashlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits

import gradcomp
import gradcomp.torch as gt

CODECS = ("none", "ddp", "q4", "topk")


def make_codec(name: str, ratio: float = 0.01, error_feedback: bool = True, seed: int = 0):
    if name == "q4":
        return gradcomp.Q4(error_feedback=error_feedback, seed=seed)
    if name == "topk":
        return gradcomp.TopK(ratio=ratio, error_feedback=error_feedback, seed=seed)
    if name == "none":
        return gradcomp.NoCompression()
    raise ValueError(f"unknown codec {name!r}; choose from {CODECS}")


def digits_split(seed: int = 0):
    """80/20 split of the bundled digits data, features scaled to [0, 1]."""
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def save_atomically(obj, path: str) -> None:
    """torch.save to `path` so that a crash leaves the old file or the new one, never a torn one: a
    temporary of a unique name in the same directory (created exclusively, so a planted file or link is
    not followed), fsynced, renamed over `path`, and the directory fsynced so that the rename lasts."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def train(codec: str = "q4", epochs: int = 30, seed: int = 0, ratio: float = 0.01, error_feedback: bool = True,
          batch: int = 32, lr: float = 0.05, device: str = "cpu", log=None, checkpoint: str = "",
          checkpoint_every: int = 50, stop_after: int = 0, on_hook=None):
    """Trains on this rank's half of the training set; returns (test accuracy, hook or None).

    With `checkpoint`, every rank saves model, optimizer, schedule, data order and gradcomp's state to
    `checkpoint`.rank<r> every `checkpoint_every` steps (written to a temporary file, fsynced, then renamed)
    and a restarted job resumes from it bit for bit. `stop_after` > 0 ends the process after that many steps
    of this run (a crash, for tests). `on_hook(hook)` runs once the hook exists, before the first step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = digits_split()
    xtr, ytr = xtr[rank::world].to(device), ytr[rank::world].to(device)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = None if codec == "ddp" else gt.register(ddp, make_codec(codec, ratio, error_feedback, seed))
    if on_hook is not None and hook is not None:
        on_hook(hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    steps_per_epoch = len(ytr) // batch
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(0.6 * total), int(0.85 * total)], gamma=0.1)
    gen = torch.Generator().manual_seed(seed + 1000 * rank)
    path = f"{checkpoint}.rank{rank}" if checkpoint else ""
    step, perm = 0, None
    if path and os.path.exists(path):
        saved = torch.load(path, weights_only=True)  # a checkpoint is data: loading it runs no code
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        gen.set_state(saved["gen"])
        step, perm = saved["step"], saved["perm"]
        if hook is not None:
            hook.load_state_dict(saved["gradcomp"])
    done_here = 0
    while step < total:
        epoch, i = divmod(step, steps_per_epoch)
        if i == 0 or perm is None:
            perm = torch.randperm(len(ytr), generator=gen)
        idx = perm[i * batch:(i + 1) * batch].to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
        opt.step()
        sched.step()
        step += 1
        done_here += 1
        if path and step % checkpoint_every == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "gen": gen.get_state(), "step": step, "perm": perm,
                     "gradcomp": hook.state_dict() if hook is not None else None}
            save_atomically(state, path)
        if stop_after and done_here == stop_after:
            os._exit(3)
        if log is not None and step % steps_per_epoch == 0:
            log(epoch, hook)
    with torch.no_grad():
        accuracy = (model(xte.to(device)).argmax(dim=1).cpu() == yte).float().mean().item()
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    if rank == 0:  # equal digests: the same model to the bit (a resumed run against a straight one)
        print(f"parameters sha256 {hashlib.sha256(flat.numpy().tobytes()).hexdigest()}", flush=True)
    return accuracy, hook


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", choices=CODECS, default="q4", help="'ddp' = no hook at all")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k ratio")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="", help="save to and resume from CHECKPOINT.rank<r>")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve gradcomp's Prometheus metrics on this port + local rank (0: off)")
    parser.add_argument("--metrics-addr", default="127.0.0.1",
                        help="address the metrics listen on (default loopback; 0.0.0.0 for a scraper on "
                             "another host, such as Prometheus in a Kubernetes cluster)")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    env = gt.launch_env()  # torchrun's variables, or Slurm's under srun without torchrun
    if use_cuda:
        torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
    gt.init_process_group("nccl" if use_cuda else "gloo")
    device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"

    def serve(hook):  # from the first step, also of a run resumed past epoch 0
        if args.metrics_port:
            gt.metrics.serve(args.metrics_port, hook, addr=args.metrics_addr)

    def log(epoch, hook):
        if dist.get_rank() == 0 and hook is not None and (epoch + 1) % 10 == 0:
            s = hook.stats()["total"]
            print(f"epoch {epoch + 1}: sent {s['bytes_sent'] / 1e6:.2f} MB, {s['ratio']:.1f}x less than an "
                  f"uncompressed allreduce", flush=True)

    accuracy, _ = train(args.codec, args.epochs, args.seed, args.ratio, not args.no_error_feedback, device=device,
                        log=log, checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every,
                        stop_after=args.stop_after, on_hook=serve)
    if dist.get_rank() == 0:
        print(f"codec={args.codec} test accuracy {accuracy:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

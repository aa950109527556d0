"""Where the codec thread runs on the CPU: beside backward on its core, or on an idle one.

One DDP rank (a world of 1 over Gloo, so the hook's codec work runs but no network is involved)
trains the end-to-end benchmark's 25.2M-parameter MLP with the q4 hook, with PyTorch using one
thread, in three set-ups measured in one run:

* ``unbound``: no OpenMP binding; the worker inherits the CPUs of the thread running backward
  and the kernel's scheduler places it ("auto" changes nothing here);
* ``omp-bound, inherit``: ``OMP_PROC_BIND=true`` binds the thread running backward to one core,
  and the worker, started by it, shares that core (what every thread did before worker_cpus);
* ``omp-bound, auto``: the same binding, and gradcomp's default lets the worker use the free core
  as well.

DDP fp32 without a hook is each set-up's floor. Small DDP buckets (``--bucket-cap-mb``, default
4) give the codec work to do while backward still runs.

    python bench/worker_placement.py [--steps 20] [--out bench/results]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SETUPS = (
    ("unbound", {}, "auto"),
    ("omp-bound, inherit", {"OMP_PROC_BIND": "true"}, "inherit"),
    ("omp-bound, auto", {"OMP_PROC_BIND": "true"}, "auto"),
)


def rank_main(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import gradcomp
    import gradcomp.torch as gt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 1), rank=0, world_size=1)
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(1024, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1024))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    hook = None if args.method == "ddp-fp32" else gt.register(ddp, gradcomp.Q4(), worker_cpus=args.worker_cpus)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(32, 1024)
    times, codec = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if hook is not None and step >= args.warmup:
            codec.append(hook.stats()["step"]["codec_seconds"])
    out = {"step_s": statistics.median(times[args.warmup:]),
           "codec_s": statistics.median(codec) if codec else None,
           "backward_cpus": sorted(os.sched_getaffinity(0)),
           "worker_cpus": hook.worker_cpus if hook else None,
           "placement": hook.worker_placement if hook else None}
    dist.destroy_process_group()
    print(json.dumps(out))


def run(args, method, env_extra, worker_cpus):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", "--method", method,
               "--worker-cpus", worker_cpus, "--store", os.path.join(tmp, "store"),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
               "--bucket-cap-mb", str(args.bucket_cap_mb)]
        env = dict(os.environ, PYTHONWARNINGS="ignore", **env_extra)
        env.pop("OMP_NUM_THREADS", None)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{method} {env_extra} {worker_cpus} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="gradcomp-q4", help=argparse.SUPPRESS)
    ap.add_argument("--worker-cpus", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2, help="each set-up this many times, interleaved")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    if len(os.sched_getaffinity(0)) < 2:
        print("needs two CPUs: with one there is no idle core to move the codec to")
        return 2
    rows = {}
    for _ in range(args.rounds):
        for name, env, worker_cpus in SETUPS:
            floor = run(args, "ddp-fp32", env, "auto")
            q4 = run(args, "gradcomp-q4", env, worker_cpus)
            row = rows.setdefault(name, {"floor": [], "q4": [], "codec": [], "worker_cpus": q4["worker_cpus"],
                                         "backward_cpus": q4["backward_cpus"], "placement": q4["placement"]})
            row["floor"].append(floor["step_s"])
            row["q4"].append(q4["step_s"])
            row["codec"].append(q4["codec_s"])
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"\n{stamp}  {platform.node()} {platform.machine()}, {os.cpu_count()} cores; one rank, "
          f"torch 1 thread, DDP buckets of {args.bucket_cap_mb:g} MB, medians of {args.rounds} runs x {args.steps} steps")
    print(f"{'set-up':22} {'backward on':>11} {'worker on':>9} {'fp32 ms':>8} {'q4 ms':>7} {'codec ms':>8} "
          f"{'q4 - fp32':>9}")
    for name, r in rows.items():
        floor, q4, codec = (statistics.median(r[k]) * 1e3 for k in ("floor", "q4", "codec"))
        print(f"{name:22} {str(r['backward_cpus']):>11} {str(r['worker_cpus']):>9} {floor:8.0f} {q4:7.0f} "
              f"{codec:8.0f} {q4 - floor:9.0f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "worker_placement.json")
    with open(path, "w") as f:
        json.dump({"date": stamp, "machine": platform.platform(), "cores": os.cpu_count(), "args": vars(args),
                   "rows": rows}, f, indent=1)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What serving gradcomp's Prometheus metrics costs a training step: 2 Gloo ranks, DDP with the q4 hook on
an 8.4M-parameter MLP, the median step time with the metrics served and scraped HZ times a second
(Prometheus usually scrapes every 15-60 s) against the same run without them, alternating A/B
rounds in one run.

    python bench/metrics_overhead.py --rounds 6 --steps 30 --hz 1
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, store, serve, port, steps, out, hz):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import gradcomp
    import gradcomp.torch as gt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = gt.register(ddp, gradcomp.Q4())
    stop = threading.Event()
    scrapes = [0]
    if serve:
        gt.metrics.serve(port + rank, hook, addr="127.0.0.1", per_rank_port=False)

        def scrape():
            while not stop.is_set():
                urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics", timeout=5).read()
                scrapes[0] += 1
                time.sleep(1.0 / hz)

        threading.Thread(target=scrape, daemon=True).start()
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(32, 1024)
    times = []
    for step in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    stop.set()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median": statistics.median(times), "scrapes": scrapes[0]}, f)


def one(serve, steps, hz):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        port = _free_port()
        procs = [ctx.Process(target=rank_main, args=(r, 2, os.path.join(tmp, "store"), serve, port, steps, out, hz))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        with open(out) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hz", type=float, default=1.0, help="scrapes per second")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = {"off": [], "served": []}
    scrapes = []
    for i in range(a.rounds):
        for serve in ((False, True) if i % 2 == 0 else (True, False)):
            r = one(serve, a.steps, a.hz)
            rows["served" if serve else "off"].append(r["median"])
            if serve:
                scrapes.append(r["scrapes"])
            print(f"round {i} {'served' if serve else 'off   '}: {r['median'] * 1e3:.1f} ms/step", flush=True)
    off, on = statistics.median(rows["off"]), statistics.median(rows["served"])
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores", "off_s": off,
              "served_s": on, "ratio": on / off, "hz": a.hz, "rounds": rows, "scrapes_per_run": scrapes}
    print(f"median step: off {off * 1e3:.1f} ms, served and scraped at {a.hz:g} Hz {on * 1e3:.1f} ms, "
          f"ratio {on / off:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end benchmark on a rate-limited link: gradcomp against PyTorch's own hooks (DDP), and
against FSDP2 in fp32 and in bf16 (the fsdp-* methods; "vs fp32/bf16" there compare with fsdp-fp32
and with fsdp-bf16-mp when it ran, else fsdp-bf16). fsdp-bf16-mp is FSDP's bf16 mixed precision
(param_dtype = reduce_dtype = bf16) as bf16 on the wire with fp32 compute: this CPU has no bf16
arithmetic (bench/fsdp_bf16_wire.py says why and how).

All ranks run inside one private network namespace and talk over its loopback, which a token
bucket (`tc ... tbf`) limits to W x the per-node rate, so that W ranks each sending at once get
about the per-node rate each, as with one network card per node. Without the privileges for
namespaces it says so and runs on the plain loopback, unlimited.

    python bench/e2e.py --quick                    # the README's main job: about 3 minutes
    python bench/e2e.py --world 2,4 --gbps 1,10    # the full run behind docs/benchmarks.md

The cpp-* methods run the same model from C++ (examples/cpp/throughput.cpp, built against the
installed package into build/example-cpp by scripts/test_all.sh; --cpp-bin to point elsewhere):
GradSync with q4, and the per-tensor blocking allreduce C++ programs write without gradcomp.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = "gradcomp-bench"
PYTHON_METHODS = ("ddp-fp32", "bf16-hook", "fp8-hook", "powersgd-r4", "quant-pertensor", "gradcomp-q4",
                  "gradcomp-q4-1piece",
                  "gradcomp-topk", "gradcomp-topk-dgc", "gradcomp-topk-sequential", "fsdp-fp32", "fsdp-bf16", "fsdp-bf16-mp",
                  "fsdp-gradcomp-q4", "fsdp-gradcomp-q4-int8", "fsdp-gradcomp-q4-int4",
                  "diloco-q4-h20", "diloco-q4-h100",
                  "diloco-q4-h20-tau5", "diloco-q4-h20-tau10", "diloco-q4-h20-tau15", "diloco-q2-h100-tau80")
# DiLoCo's rounds every H steps, (H, tau): timed over whole rounds (at least two), the mean step. With
# overlap (tau > 0) a round's merge comes tau steps after its sync point: the warm-up grows by tau so that
# the timed steps hold every timed round's sync point and its merge.
DILOCO = {"diloco-q4-h20": (20, 0), "diloco-q4-h100": (100, 0), "diloco-q4-h20-tau5": (20, 5),
          "diloco-q4-h20-tau10": (20, 10), "diloco-q4-h20-tau15": (20, 15), "diloco-q2-h100-tau80": (100, 80)}
CPP_METHODS = ("cpp-allreduce", "cpp-gradsync-q4")
TRACED = ("gradcomp-q4", "gradcomp-q4-1piece", "gradcomp-topk", "gradcomp-topk-sequential")
METHODS = PYTHON_METHODS + CPP_METHODS
CPP_BIN = os.path.join(HERE, "..", "build", "example-cpp", "throughput")


class Link:
    """The namespace and its loopback rate limit (or plain loopback when that is not allowed)."""

    def __init__(self):
        self.prefix, self.limited, self.note = [], False, ""
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            self.note = "no root or no iproute2: plain loopback, no rate limit"
            return
        subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
        r = subprocess.run(["ip", "netns", "add", NETNS], capture_output=True, text=True)
        if r.returncode != 0:
            self.note = f"cannot create a network namespace ({r.stderr.strip()}): plain loopback, no rate limit"
            return
        subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"], check=True)
        self.prefix = ["ip", "netns", "exec", NETNS]

    def set_rate(self, gbps_total: float) -> bool:
        if not self.prefix:
            return False
        burst = max(256 * 1024, int(gbps_total * 1e9 / 8 / 250))
        r = subprocess.run(self.prefix + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                                          f"{gbps_total}gbit", "burst", str(burst), "latency", "100ms"],
                           capture_output=True, text=True)
        self.limited = r.returncode == 0
        if not self.limited:
            self.note = f"tc failed ({r.stderr.strip()}): loopback unlimited"
        return self.limited

    def close(self):
        if self.prefix:
            subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)


def run_ranks(link, mode, method, world, extra, timeout, copies=1, cpp_bin=CPP_BIN, placement=None):
    """Starts `world` worker processes (or `copies` independent single-rank ones when world is 1);
    returns rank 0's result dict. `placement(rank)` -> (command prefix, environment, arguments)
    puts a rank elsewhere than the link's namespace (bench/e2e_nodes.py: one namespace per node)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        port = 29600 + (os.getpid() + int(time.time() * 1000)) % 2000
        procs = []
        for rank in range(max(world, copies)):
            rank_out = out if rank == 0 else out + f".{rank}"
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            prefix, rank_extra = link.prefix, []
            if placement is not None:
                prefix, rank_env, rank_extra = placement(rank)
                env.update(rank_env)
            if method in CPP_METHODS:
                cmd = prefix + [cpp_bin, "--method", method[len("cpp-"):], "--out", rank_out] + extra
                env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            else:
                cmd = prefix + [sys.executable, os.path.join(HERE, "e2e_worker.py"), "--mode", mode, "--method",
                                method, "--rank", str(rank if world > 1 else 0), "--world", str(world),
                                "--port", str(port), "--out", rank_out] + extra + rank_extra
            err = open(os.path.join(tmp, f"stderr.{rank}"), "w")
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env))
        deadline = time.time() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.path.exists(out):
            lines = [l.strip() for l in open(os.path.join(tmp, "stderr.0")).read().splitlines()
                     if l.strip() and not l.startswith("W1") and "Fatal Python" not in l]
            why = next((l for l in lines if "what()" in l or "Error" in l), lines[-1] if lines else "no output")
            return {"ok": False, "error": f"rank 0 exited with {procs[0].returncode} and no result: {why[:160]}"}
        with open(out) as f:
            return json.load(f)


def fmt_bytes(b):
    return f"{b / 1e6:8.1f} MB" if b is not None else "       -"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="2", help="comma list of world sizes")
    ap.add_argument("--gbps", default="1", help="comma list of per-node link rates in Gbit/s")
    # The FSDP methods are a comparison of their own
    # (--methods fsdp-fp32,fsdp-bf16-mp,fsdp-gradcomp-q4,fsdp-gradcomp-q4-int8).
    # So is DiLoCo's (--methods ddp-fp32,gradcomp-q4,diloco-q4-h20,diloco-q4-h100), which times hundreds of steps.
    ap.add_argument("--methods", default=",".join(m for m in METHODS if not m.startswith(("fsdp", "diloco"))))
    ap.add_argument("--cpp-bin", default=CPP_BIN, help="examples/cpp's throughput program")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--per-step-steps", type=int, default=0,
                    help="timed steps of the per-step methods when fewer than --steps (0: --steps); on the slowest "
                         "links a DDP fp32 step takes a minute")
    ap.add_argument("--skip", default="", help="comma list of method@gbps pairs not to run (too slow there)")
    ap.add_argument("--no-digits", action="store_true", help="step times only, no digits training")
    ap.add_argument("--hidden", type=int, default=4096, help="4096 gives a 25.2M-parameter model")
    ap.add_argument("--digits-epochs", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="2 ranks, 1 Gbit/s, 8 steps, 5 digits epochs")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap, the same for every method")
    ap.add_argument("--trace", action="store_true",
                    help="profile one more step of the methods in TRACED at the first rate (bench/timeline.py)")
    args = ap.parse_args()
    if args.quick:
        args.world, args.gbps, args.steps, args.warmup, args.digits_epochs = "2", "1", 8, 2, 5
    try:
        worlds = [int(w) for w in args.world.split(",")]
        rates = [float(g) for g in args.gbps.split(",")]
    except ValueError:
        ap.error("--world and --gbps take comma-separated numbers")
    methods = args.methods.split(",")
    skip = {tuple(pair.split("@")) for pair in args.skip.split(",") if pair}
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if any(m in CPP_METHODS for m in methods) and not os.access(args.cpp_bin, os.X_OK):
        print(f"note: {args.cpp_bin} not built (scripts/test_all.sh builds it): no cpp-* methods", flush=True)
        methods = [m for m in methods if m not in CPP_METHODS]
    if any(w < 2 or w > 8 for w in worlds) or any(g <= 0 for g in rates):
        ap.error("world sizes must be 2..8 and rates positive")
    os.makedirs(args.out, exist_ok=True)

    link = Link()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "link_note": link.note, "config": vars(args), "throughput": [], "limit": {}, "digits": []}
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
             "--bucket-cap-mb", str(args.bucket_cap_mb)]
    try:
        digit_methods = [] if args.no_digits else [m for m in methods if m in PYTHON_METHODS]
        total = len(worlds) * (1 + len(rates) * len(methods)) + len(digit_methods)
        done = 0
        for world in worlds:
            # The limit: the same model and per-rank batch with no communication, W copies at once
            # so that the CPU is shared as in the W-rank runs.
            link.set_rate(1000)
            done += 1
            print(f"[{done}/{total}] limit: W={world} independent single-rank runs", flush=True)
            limit = run_ranks(link, "throughput", "ddp-fp32", 1, extra, args.timeout, copies=world)
            results["limit"][str(world)] = limit
            for gbps in rates:
                limited = link.set_rate(gbps * world)
                for method in methods:
                    done += 1
                    if (method, f"{gbps:g}") in skip:
                        print(f"[{done}/{total}] W={world} {gbps:g} Gbit/s {method}: skipped (--skip)", flush=True)
                        continue
                    print(f"[{done}/{total}] W={world} {gbps:g} Gbit/s {method}", flush=True)
                    trace = []
                    if args.trace and gbps == rates[0] and method in TRACED:
                        trace = ["--trace", os.path.join(args.out, f"trace_{method}_w{world}_{gbps:g}g")]
                    method_extra = extra
                    if method in DILOCO:
                        h, tau = DILOCO[method]
                        method_extra = extra + ["--steps", str(max(2, -(-args.steps // h)) * h),
                                                "--warmup", str(args.warmup + tau)]
                    elif args.per_step_steps and method in PYTHON_METHODS:
                        method_extra = extra + ["--steps", str(min(args.steps, args.per_step_steps))]
                    r = run_ranks(link, "throughput", method, world, method_extra + trace, args.timeout,
                                  cpp_bin=args.cpp_bin)
                    results["throughput"].append({"world": world, "gbps": gbps, "rate_limited": limited,
                                                  "method": method, **r})
        link.set_rate(rates[0] * 2)
        for method in digit_methods:
            done += 1
            print(f"[{done}/{total}] digits, W=2, {rates[0]:g} Gbit/s, {method}", flush=True)
            r = run_ranks(link, "digits", method, 2, ["--epochs", str(args.digits_epochs)], args.timeout)
            results["digits"].append({"method": method, **r})
    finally:
        link.close()

    path = os.path.join(args.out, "e2e.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print_table(results)
    plot(results, args.out)
    print(f"\nresults: {path}; plots: {args.out}/step_time.png, {args.out}/digits_accuracy.png")


def fsdp_bf16_baseline(base) -> str:
    """The FSDP bf16 row the others are compared with: mixed precision as users run it, when measured."""
    return "fsdp-bf16-mp" if "fsdp-bf16-mp" in base else "fsdp-bf16"


def print_fsdp_ratios(base, limit):
    """Per FSDP method: step-time and bytes ratios against FSDP fp32 and bf16 mixed precision, and the
    exposed communication (step time over the no-communication limit's)."""
    fsdp = {m: r for m, r in base.items() if m.startswith("fsdp")}
    ref = {"fp32": fsdp.get("fsdp-fp32"), "bf16": fsdp.get(fsdp_bf16_baseline(base))}
    if len(fsdp) < 2 or not any(ref.values()):
        return
    print(f"{'FSDP':24s} {'faster vs fp32':>15s} {'vs bf16':>8s} {'fewer bytes vs fp32':>20s} {'vs bf16':>8s} "
          f"{'exposed comm ms':>16s}")
    for m, r in fsdp.items():
        step, sent = r["step_s"], r["bytes_per_step_per_rank"]
        ratio = lambda b, key: f"{b[key] / (step if key == 'step_s' else sent):7.2f}x" if b else "      -"  # noqa: E731
        exposed = f"{(step - limit) * 1e3:16.0f}" if limit else "               -"
        print(f"{m:24s} {ratio(ref['fp32'], 'step_s'):>15s} {ratio(ref['bf16'], 'step_s'):>8s} "
              f"{ratio(ref['fp32'], 'bytes_per_step_per_rank'):>20s} {ratio(ref['bf16'], 'bytes_per_step_per_rank'):>8s}"
              f" {exposed}")


def print_table(results):
    print(f"\n{results['date']}  {results['machine']}")
    if results["link_note"]:
        print(f"note: {results['link_note']}")
    rows = results["throughput"]
    for (world, gbps) in sorted({(r["world"], r["gbps"]) for r in rows}):
        group = [r for r in rows if r["world"] == world and r["gbps"] == gbps]
        base = {r["method"]: r for r in group if r.get("ok")}
        limit = results["limit"].get(str(world), {}).get("step_s")
        print(f"\nW={world}, {gbps:g} Gbit/s per node" + (f", limit (no communication) {limit * 1e3:.0f} ms/step" if limit else ""))
        print(f"{'method':24s} {'step ms':>9s} {'bytes/step/rank':>16s} {'vs fp32':>8s} {'vs bf16':>8s} {'vs limit':>9s} {'codec ms':>9s}")
        for r in group:
            if not r.get("ok"):
                print(f"{r['method']:24s} failed: {r.get('error', '?')}")
                continue
            s = r["step_s"]
            # FSDP rows against FSDP's own reduce-scatter in fp32 and bf16; DDP rows against DDP's.
            fsdp = r["method"].startswith("fsdp")
            fp32 = base.get("fsdp-fp32" if fsdp else "ddp-fp32", {}).get("step_s")
            bf16 = base.get(fsdp_bf16_baseline(base) if fsdp else "bf16-hook", {}).get("step_s")
            vs = lambda b: f"{b / s:7.2f}x" if b else "      -"
            codec = f"{r['codec_s'] * 1e3:9.0f}" if r.get("codec_s") is not None else "        -"
            name = r["method"] + (" (1 bucket)" if r["method"] == "quant-pertensor" else "")
            print(f"{name:24s} {s * 1e3:9.0f} {fmt_bytes(r['bytes_per_step_per_rank']):>16s} {vs(fp32):>8s} "
                  f"{vs(bf16):>8s} {s / limit if limit else float('nan'):8.2f}x {codec}")
        print_fsdp_ratios(base, limit)
        fp32 = base.get("ddp-fp32", {}).get("step_s")
        cpp_loop, cpp_q4, hook = (base.get(m, {}).get("step_s") for m in ("cpp-allreduce", "cpp-gradsync-q4",
                                                                          "gradcomp-q4"))
        if cpp_loop and cpp_q4:
            line = f"C++: GradSync q4 is {cpp_loop / cpp_q4:.2f}x the per-tensor allreduce loop"
            if fp32 and hook:
                line += f" (the Python hook: {fp32 / hook:.2f}x DDP fp32); GradSync / Python hook step time " \
                        f"{cpp_q4 / hook:.2f}"
            print(line)
    if results["digits"]:
        print("\ndigits (2 ranks): final test accuracy, wall time")
        for r in results["digits"]:
            if r.get("ok"):
                print(f"{r['method']:24s} {r['final_accuracy']:.4f}  {r['curve'][-1][0]:6.1f} s")
            else:
                print(f"{r['method']:24s} failed: {r.get('error', '?')}")
        if any(r["method"].startswith("gradcomp-topk") for r in results["digits"]):
            print("gradcomp-topk: top-k 1 % under the optimizer's own momentum 0.9 (each coordinate's accumulated\n"
                  "  burst is then carried on by the momentum: it trails dense on short runs); gradcomp-topk-dgc: the\n"
                  "  recommended setting for SGD, DGC's momentum correction (TopK(momentum=0.9), SGD without momentum,\n"
                  "  lr x3; docs/benchmarks.md). With Adam-family optimizers use Q4 or DiLoCo instead.")


def step_time_bars(plt, rows, methods, config_of, limit_of, label_of, title, path, log=False):
    """Median step time per method (bars) and configuration (groups), the no-communication limit
    dashed; shared by bench/e2e.py and bench/e2e_nodes.py."""
    configs = sorted({config_of(r) for r in rows})
    methods = [m for m in methods if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ys = [next((r["step_s"] * 1e3 for r in rows if r["method"] == m and config_of(r) == c), 0)
              for c in configs]
        ax.bar([j + i * width for j in range(len(configs))], ys, width, label=m)
    for j, c in enumerate(configs):
        limit = limit_of(c)
        if limit:
            ax.hlines(limit * 1e3, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="dashed")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
    ax.set_xticklabels([label_of(c) for c in configs])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("median step time (ms" + (", log" if log else "") + "); dashed: no communication")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parallelism_of(methods) -> str:
    """What the plotted methods trained with, for the plot's title: DDP (its hooks, gradcomp's and the
    C++ programs'), FSDP2 (fsdp-*), DiLoCo (diloco-*), joined when a run mixed them."""
    kinds = {"FSDP2" if m.startswith("fsdp") else "DiLoCo" if m in DILOCO else "DDP" for m in methods}
    return " and ".join(k for k in ("DDP", "FSDP2", "DiLoCo") if k in kinds)


def plot(results, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    rows = [r for r in results["throughput"] if r.get("ok")]
    step_time_bars(plt, rows, METHODS, lambda r: (r["world"], r["gbps"]),
                   lambda c: results["limit"].get(str(c[0]), {}).get("step_s"),
                   lambda c: f"W={c[0]}, {c[1]:g} Gbit/s",
                   f"25M-parameter MLP, {parallelism_of(r['method'] for r in rows)} on CPU/Gloo ({results['date'][:10]})",
                   os.path.join(out, "step_time.png"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results["digits"]:
        if r.get("ok"):
            t, a = zip(*r["curve"])
            ax.plot(t, a, marker=".", label=r["method"])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits, 2 ranks: accuracy against wall time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "digits_accuracy.png"), dpi=110)


if __name__ == "__main__":
    main()

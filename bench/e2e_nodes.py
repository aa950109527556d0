"""Two simulated nodes of L ranks each: flat against hierarchical compression, side by side.

Each node is a private network namespace holding its L ranks. A veth pair joins the two nodes,
and a token bucket (`tc ... tbf`) limits each node's egress on it to the per-node rate, as one
network card per node would. Ranks of one node reach each other at the node's own address, so
that traffic stays on the node's loopback, unlimited (NVLink's stand-in). Bytes between nodes
are read from the veth's counters. Needs root and iproute2; without them it says so and stops.

    python bench/e2e_nodes.py --quick                  # 2 x 2 at 1 Gbit/s, a few steps (CI)
    python bench/e2e_nodes.py --local 2 --gbps 1,10    # the run behind docs/benchmarks.md
    python bench/e2e_nodes.py --trace                   # also one profiled step per method

Methods: DDP fp32, PyTorch's bf16 hook, PowerSGD rank 4 (one bucket, see e2e_worker.py), flat and
hierarchical gradcomp q4 and top-k 1 %. The limit is the same model with no communication.
HSDP (FSDP2 sharded inside a node, replicated across nodes; a comparison of its own, "vs fp32/bf16"
there against hsdp-fp32 and hsdp-bf16-mp): `--methods hsdp-fp32,hsdp-bf16-mp,hsdp-gradcomp-q4-int8`;
hsdp-bf16-mp is bf16 mixed precision's traffic with fp32 compute (bench/fsdp_bf16_wire.py).
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e  # noqa: E402

NODES = 2
ADDRESSES = ("10.77.0.1", "10.77.0.2")
METHODS = ("ddp-fp32", "bf16-hook", "fp8-hook", "powersgd-r4", "gradcomp-q4", "gradcomp-q4-1piece", "gradcomp-q4-hier",
           "gradcomp-q4-hier-1piece", "gradcomp-topk", "gradcomp-topk-hier", "hsdp-fp32", "hsdp-bf16-mp",
           "hsdp-gradcomp-q4-int8")
TRACED = ("ddp-fp32", "gradcomp-q4", "gradcomp-q4-hier", "gradcomp-topk-hier")


def namespace(node: int) -> str:
    return f"gradcomp-node{node}"


def veth(node: int) -> str:
    return f"gc-veth{node}"


class Nodes:
    """The nodes' namespaces and the rate-limited veth pair between them."""

    def __init__(self):
        self.ok, self.note = False, ""
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            self.note = "needs root and iproute2 (ip, tc) for the network namespaces"
            return
        self.close()
        try:
            for n in range(NODES):
                self._run(["ip", "netns", "add", namespace(n)])
                self._run(["ip", "-n", namespace(n), "link", "set", "lo", "up"])
            self._run(["ip", "link", "add", veth(0), "netns", namespace(0), "type", "veth", "peer", "name", veth(1),
                       "netns", namespace(1)])
            for n in range(NODES):
                self._run(["ip", "-n", namespace(n), "addr", "add", f"{ADDRESSES[n]}/24", "dev", veth(n)])
                self._run(["ip", "-n", namespace(n), "link", "set", veth(n), "up"])
        except subprocess.CalledProcessError as e:
            self.note = f"cannot build the nodes ({(e.stderr or '').strip()})"
            self.close()
            return
        self.ok = True
        self.prefix = self.exec_prefix(0)

    @staticmethod
    def _run(cmd):
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    @staticmethod
    def exec_prefix(node: int) -> list:
        return ["ip", "netns", "exec", namespace(node)]

    def set_rate(self, gbps: float) -> bool:
        """Each node's egress to the other: `gbps`; unlimited for 0."""
        burst = max(256 * 1024, int(gbps * 1e9 / 8 / 250))
        for n in range(NODES):
            cmd = ["tc", "-n", namespace(n), "qdisc", "replace", "dev", veth(n), "root", "tbf", "rate",
                   f"{gbps}gbit", "burst", str(burst), "latency", "100ms"]
            if gbps <= 0:
                cmd = ["tc", "-n", namespace(n), "qdisc", "del", "dev", veth(n), "root"]
            if subprocess.run(cmd, capture_output=True).returncode != 0 and gbps > 0:
                return False
        return True

    def close(self):
        for n in range(NODES):
            subprocess.run(["ip", "netns", "del", namespace(n)], capture_output=True)


def placement(local: int, trace: str = ""):
    def place(rank):
        node = rank // local
        extra = ["--master", ADDRESSES[0], "--iface", veth(node), "--local-world-size", str(local)]
        if trace:
            extra += ["--trace", trace]
        return Nodes.exec_prefix(node), {"GLOO_SOCKET_IFNAME": veth(node)}, extra
    return place


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", default="2", help="comma list of ranks per node")
    ap.add_argument("--gbps", default="1,10", help="comma list of per-node link rates in Gbit/s")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096, help="4096 gives a 25.2M-parameter model")
    ap.add_argument("--trace", action="store_true", help="profile one step of " + ", ".join(TRACED))
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap, the same for every method")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="2 x 2 at 1 Gbit/s, q4 flat and hierarchical, 4 steps")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    if args.quick:
        args.local, args.gbps, args.steps, args.warmup, args.hidden = "2", "1", 4, 1, 2048
        args.methods = "ddp-fp32,gradcomp-q4,gradcomp-q4-hier"
    locals_ = [int(x) for x in args.local.split(",")]
    rates = [float(x) for x in args.gbps.split(",")]
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    nodes = Nodes()
    if not nodes.ok:
        print(f"e2e_nodes: {nodes.note}; nothing measured", flush=True)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "config": vars(args), "throughput": [], "limit": {}}
    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
             "--bucket-cap-mb", str(args.bucket_cap_mb)]
    try:
        for local in locals_:
            world = NODES * local
            nodes.set_rate(0)
            print(f"limit: {world} independent single-rank runs", flush=True)
            results["limit"][str(local)] = e2e.run_ranks(nodes, "throughput", "ddp-fp32", 1, extra, args.timeout,
                                                         copies=world)
            for i, gbps in enumerate(rates):
                limited = nodes.set_rate(gbps)
                for method in methods:
                    trace = ""
                    if args.trace and i == 0 and method in TRACED:
                        trace = os.path.join(args.out, f"trace_{method}_{NODES}x{local}_{gbps:g}g")
                    print(f"{NODES} x {local}, {gbps:g} Gbit/s per node: {method}", flush=True)
                    r = e2e.run_ranks(nodes, "throughput", method, world, extra, args.timeout,
                                      placement=placement(local, trace))
                    results["throughput"].append({"nodes": NODES, "local": local, "gbps": gbps,
                                                  "rate_limited": limited, "method": method, "trace": trace, **r})
    finally:
        nodes.close()
    path = os.path.join(args.out, "e2e_nodes.json" if not args.quick else "e2e_nodes_quick.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    failed = print_table(results)
    if not args.quick:
        plot(results, args.out)
    print(f"\nresults: {path}")
    return 1 if failed else 0


def print_table(results) -> bool:
    print(f"\n{results['date']}  {results['machine']}")
    failed = False
    rows = results["throughput"]
    for (local, gbps) in sorted({(r["local"], r["gbps"]) for r in rows}):
        group = [r for r in rows if r["local"] == local and r["gbps"] == gbps]
        base = {r["method"]: r for r in group if r.get("ok")}
        limit = results["limit"].get(str(local), {}).get("step_s")
        print(f"\n{NODES} nodes x {local} ranks, {gbps:g} Gbit/s per node"
              + (f", limit (no communication) {limit * 1e3:.0f} ms/step" if limit else ""))
        print(f"{'method':20s} {'step ms':>9s} {'between nodes':>14s} {'vs fp32':>8s} {'vs bf16':>8s} "
              f"{'vs limit':>9s} {'vs flat':>8s}")
        for r in group:
            if not r.get("ok"):
                failed = True
                print(f"{r['method']:20s} failed: {r.get('error', '?')}")
                continue
            s = r["step_s"]
            hsdp = r["method"].startswith("hsdp")
            fp32 = base.get("hsdp-fp32" if hsdp else "ddp-fp32", {}).get("step_s")
            bf16 = base.get("hsdp-bf16-mp" if hsdp else "bf16-hook", {}).get("step_s")
            vs = lambda b: f"{b / s:7.2f}x" if b else "      -"  # noqa: E731
            flat = base.get(r["method"].replace("-hier", ""), {}).get("step_s") if r["method"].endswith("-hier") else None
            name = r["method"]
            print(f"{name:20s} {s * 1e3:9.0f} {e2e.fmt_bytes(r['link_bytes_per_step']):>14s} {vs(fp32):>8s} "
                  f"{vs(bf16):>8s} {s / limit if limit else float('nan'):8.2f}x {vs(flat):>8s}")
        for kind in ("q4", "topk"):
            f, h = base.get(f"gradcomp-{kind}"), base.get(f"gradcomp-{kind}-hier")
            if f and h:
                print(f"{kind}: hierarchical sends {h['link_bytes_per_step'] / f['link_bytes_per_step']:.3f} of the "
                      f"flat scheme's bytes between nodes (1/L = {1 / local:.3f})")
    return failed


def plot(results, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    rows = [r for r in results["throughput"] if r.get("ok")]
    e2e.step_time_bars(plt, rows, METHODS, lambda r: (r["local"], r["gbps"]),
                       lambda c: results["limit"].get(str(c[0]), {}).get("step_s"),
                       lambda c: f"{NODES} x {c[0]}, {c[1]:g} Gbit/s",
                       f"25M-parameter MLP, two simulated nodes, CPU/Gloo ({results['date'][:10]})",
                       os.path.join(out, "step_time_nodes.png"), log=True)


if __name__ == "__main__":
    sys.exit(main())

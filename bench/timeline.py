"""Summarises one profiled training step per rank (Chrome traces from bench/e2e_worker.py
--trace) into where the step's time went: communication hidden behind backward, exposed time on
the critical path, codec time, and draws the timeline.

    python bench/timeline.py bench/results/trace_gradcomp-q4-hier_2x2_1g       # all ranks' files
    python bench/timeline.py PREFIX --plot timeline.png --json summary.json

A step is forward, backward and the optimizer (the step::* ranges). Backward's compute ends with
the last autograd function; what backward spends after it is the wait for the last buckets
(DDP waits for every bucket's future in its final callback), which is exposed time. Collectives
are gradcomp's named phases (gradcomp::all_to_all, all_gather, reduce_scatter, allreduce); for a
method without gradcomp, the c10d collective calls.
"""
import argparse
import glob
import json
import os

COMM = ("gradcomp::all_to_all", "gradcomp::all_gather", "gradcomp::reduce_scatter", "gradcomp::allreduce")
CODEC = ("gradcomp::q4_encode", "gradcomp::q4_decode", "gradcomp::topk_encode", "gradcomp::topk_decode",
         "gradcomp::check_payloads", "gradcomp::copy", "gradcomp::topk_accumulate", "gradcomp::topk_mask")


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(intervals):
    return sum(b - a for a, b in intervals)


def clip(intervals, lo, hi):
    return [[max(a, lo), min(b, hi)] for a, b in intervals if min(b, hi) > max(a, lo)]


def intersect(a, b):
    """The time two unions of intervals cover together."""
    out = []
    for lo, hi in a:
        out += clip(b, lo, hi)
    return out


def events(path):
    with open(path) as f:
        trace = json.load(f)
    rows = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in rows if e.get("ph") == "X" and "dur" in e]


def summarise(path):
    """Milliseconds of one rank's step: the step, forward, backward compute, the tail after it,
    communication (all, hidden behind backward compute, exposed) and codec time."""
    ev = events(path)

    def span(name):
        hits = [e for e in ev if e["name"] == name]
        if not hits:
            raise ValueError(f"{path}: no {name} range (was it recorded by bench/e2e_worker.py --trace?)")
        e = max(hits, key=lambda e: e["dur"])
        return e["ts"], e["ts"] + e["dur"]

    f0, f1 = span("step::forward")
    b0, b1 = span("step::backward")
    o0, o1 = span("step::optimizer")
    autograd = [e["ts"] + e["dur"] for e in ev
                if e["name"].startswith("autograd::engine::evaluate_function") and b0 <= e["ts"] <= b1]
    compute_end = max(autograd) if autograd else b1
    def is_c10d_collective(name):
        return (name.startswith("c10d::") and "reduce" in name) or name.startswith("gloo:")

    collective = (lambda name: name in COMM) if any(e["name"] in COMM for e in ev) else is_c10d_collective
    comm = union([[e["ts"], e["ts"] + e["dur"]] for e in ev if collective(e["name"])])
    codec = union([[e["ts"], e["ts"] + e["dur"]] for e in ev if e["name"] in CODEC])
    comm = clip(comm, f0, o1)
    codec = clip(codec, f0, o1)
    ms = lambda us: us / 1e3  # noqa: E731
    return {
        "step_ms": ms(o1 - f0), "forward_ms": ms(f1 - f0), "backward_compute_ms": ms(compute_end - b0),
        "tail_ms": ms(b1 - compute_end), "optimizer_ms": ms(o1 - o0),
        "comm_ms": ms(length(comm)), "comm_hidden_ms": ms(length(clip(comm, b0, compute_end))),
        "comm_exposed_ms": ms(length(comm) - length(clip(comm, b0, compute_end))),
        "codec_ms": ms(length(codec)), "codec_exposed_ms": ms(length(codec) - length(clip(codec, b0, compute_end))),
        # Collectives on the wire while the codec works on other pieces (pipelined reductions).
        "comm_under_codec_ms": ms(length(intersect(comm, codec))),
        "buckets": sum(1 for e in ev if e["name"] == "gradcomp::hook_bucket"),
    }


def plot(paths, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = [("forward", "step::forward", "tab:gray"), ("optimizer", "step::optimizer", "tab:olive"),
             ("encode/decode", CODEC, "tab:orange"), ("collective", COMM, "tab:red")]
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.7 * len(paths)))
    for row, path in enumerate(paths):
        ev = events(path)
        origin = min(e["ts"] for e in ev if e["name"] == "step::forward")
        s = summarise(path)
        b0 = next(e["ts"] for e in ev if e["name"] == "step::backward") - origin
        compute_end = b0 + s["backward_compute_ms"] * 1e3
        ax.broken_barh([(b0 / 1e3, s["backward_compute_ms"])], (row + 0.05, 0.4), color="tab:blue",
                       label="backward compute" if row == 0 else None)
        ax.broken_barh([(compute_end / 1e3, s["tail_ms"])], (row + 0.05, 0.4), color="lightsteelblue",
                       label="backward: waiting for buckets" if row == 0 else None)
        for k, (label, names, color) in enumerate(kinds):
            names = (names,) if isinstance(names, str) else names
            spans = union([[e["ts"] - origin, e["ts"] + e["dur"] - origin] for e in ev if e["name"] in names])
            # Codec and collectives in rows of their own: with pieces they overlap.
            y, h = ((row + 0.05, 0.4), (row + 0.05, 0.4), (row + 0.5, 0.2), (row + 0.72, 0.2))[k]
            ax.broken_barh([(a / 1e3, (b - a) / 1e3) for a, b in spans], (y, h), color=color,
                           label=label if row == 0 else None)
    ax.set_yticks([r + 0.5 for r in range(len(paths))])
    ax.set_yticklabels([f"rank {r}" for r in range(len(paths))])
    ax.set_xlabel("ms since the step began (upper half: the step; lower: gradcomp's codec, then its collectives)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix", help="trace files PREFIX.rank<r>.json")
    ap.add_argument("--plot", help="write the timeline picture here")
    ap.add_argument("--json", help="write the per-rank summaries here")
    args = ap.parse_args()
    paths = sorted(glob.glob(f"{args.prefix}.rank*.json"), key=lambda p: int(p.rsplit("rank", 1)[1].split(".")[0]))
    if not paths:
        raise SystemExit(f"no traces {args.prefix}.rank*.json")
    rows = [summarise(p) for p in paths]
    cols = list(rows[0])
    print(f"{os.path.basename(args.prefix)}")
    print("rank " + " ".join(f"{c[:-3] if c.endswith('_ms') else c:>17s}" for c in cols))
    for r, row in enumerate(rows):
        print(f"{r:4d} " + " ".join(f"{row[c]:17.1f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(paths, args.plot, os.path.basename(args.prefix))


if __name__ == "__main__":
    main()

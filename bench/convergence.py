"""Convergence of top-k and its remedies, FSDP2 and DiLoCo: a small causal transformer with AdamW, and the
digits MLP with SGD and momentum, on W Gloo ranks (CPU), several seeds; dense DDP beside every codec.

The language model is character-level on the English text of Python's own documentation topics
(`pydoc_data.topics`, shipped with every CPython: no download). Every method of one task sees
the same data, initial weights and seeds; only the gradient communication differs.

A second LM (`--tasks lm2`, issue 36's "show it on both LMs") differs from the first where it matters: a
GPT-style decoder (pre-norm blocks of causal self-attention and a GELU MLP, GPT-2 initialisation, tied input and
output embeddings; width 96, 6 layers, 3 heads: 0.70 M parameters, against the first's width 128, 4 layers,
untied head), byte-level (256 symbols), trained on Python source instead of English prose: these 20 files of the
running interpreter's standard library (sysconfig's "stdlib" directory), in this order, joined by a newline:
argparse.py ast.py collections/__init__.py dataclasses.py difflib.py enum.py functools.py heapq.py inspect.py
json/decoder.py json/encoder.py logging/__init__.py pathlib.py random.py shutil.py subprocess.py tempfile.py
textwrap.py threading.py typing.py (1,181,126 bytes on CPython 3.11.7; sha256 in LM2_CORPUS_SHA256, checked on
that version and printed by every lm2 run). AdamW as GPT-style decoders train (lr 3e-3, betas 0.9 / 0.95, weight
decay 0.1), the same warm-up and cosine schedule; the last 5 % of the bytes are held out.

    python bench/convergence.py                       # the full run behind docs/benchmarks.md
    python bench/convergence.py --quick               # CI: short, one seed, asserts the remedy helps
    python bench/convergence.py --tasks lm --methods dense,topk,topk-warmup --seeds 0,1,2
    # the second LM: DiLoCo's defaults against 1.0 / 0.3, 300 steps from scratch (15 rounds at H = 20)
    python bench/convergence.py --tasks lm2 --methods dense,diloco-h20,diloco-h20-lr1.0-m0.3 --seeds 0,1,2 --steps 300
    python bench/convergence.py --tasks lm --methods dense,q4,diloco-h20-lr1.0-m0 --gbps 0.1   # on a 100 Mbit/s link
    # DiLoCo from a dense checkpoint of the same run: dense DDP for 100 steps, then DiLoCo (q4, and Q2) for 400
    # (20 rounds at H = 20); dense goes on unchanged; the held-out loss also every 100 steps
    python bench/convergence.py --tasks lm --methods dense,diloco-h20-lr1.0-m0.3,diloco-h20-lr1.0-m0.3-q2 \
        --seeds 0 --steps 500 --warm-start 100 --eval-every 100
"""
import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from convergence_lm2 import LM2_CORPUS_BYTES, LM2_CORPUS_PYTHON, lm2_corpus, lm2_corpus_bytes, lm2_optimizer, make_lm2

# What each method hands the hook: (codec keyword arguments or None for dense DDP, optimizer kind).
# "sgd-dgc" is SGD without momentum: momentum correction applies the momentum in the hook;
# "sgd-dgc-tuned" the same at the learning rate a sweep chose (docs/benchmarks.md).
METHODS = {
    "dense": (None, None),
    "q4": ({"codec": "q4"}, None),
    "topk": ({"codec": "topk"}, None),
    "topk-warmup": ({"codec": "topk", "warmup_steps": 100}, None),
    "topk-warmup-long": ({"codec": "topk", "warmup_steps": 200}, None),
    "topk-clip": ({"codec": "topk", "clip_norm": 1.0}, None),
    "topk-warmup-clip": ({"codec": "topk", "warmup_steps": 100, "clip_norm": 1.0}, None),
    "topk-dgc": ({"codec": "topk", "momentum": 0.9, "warmup_steps": 100, "clip_norm": 1.0}, "sgd-dgc"),
    "topk-dgc-tuned": ({"codec": "topk", "momentum": 0.9}, "sgd-dgc-tuned"),
    # q4 for the first steps, then top-k: Adam's moments settle on (nearly) dense gradients.
    "topk-q4warmup-100": ({"codec": "topk", "warmup": "q4", "warmup_steps": 100}, None),
    "topk-q4warmup": ({"codec": "topk", "warmup": "q4", "warmup_steps": 200}, None),
    "topk-q4warmup-long": ({"codec": "topk", "warmup": "q4", "warmup_steps": 300}, None),
    # FSDP2 (fully_shard per layer) with its own fp32 reduce-scatter, or with gradcomp's q4 one.
    "fsdp-dense": (None, None),
    "fsdp-q4": ({"codec": "q4"}, None),
    # ... and with int8 weight all-gathers (gradcomp.torch.fsdp(..., params=gradcomp.Int8())).
    "fsdp-q4-int8": ({"codec": "q4", "params": "int8"}, None),
    # ... and with 4-bit round-to-nearest weights of blocks of 16 / 32 / 64 in plain PyTorch (bench/weight_q4.py):
    # the measurement behind the 4-bit weight option (docs/benchmarks.md, "Loss with 4-bit weights").
    "fsdp-q4-w4-b16": ({"codec": "q4", "params": "w4", "weight_block": 16}, None),
    "fsdp-q4-w4-b32": ({"codec": "q4", "params": "w4", "weight_block": 32}, None),
    "fsdp-q4-w4-b64": ({"codec": "q4", "params": "w4", "weight_block": 64}, None),
}
# DiLoCo: no per-step synchronisation; every H steps the q4 outer gradient and the outer Nesterov SGD.
# "diloco-h<H>[-lr<outer lr>][-m<outer momentum>][-f<fragments>][-ilr<inner lr>][-q2]", e.g. diloco-h50-lr1.0-m0.5;
# "-q2": the outer gradients as gradcomp.Q2 (2 bits) instead of Q4; "-none": uncompressed fp32 outer gradients
# (bench/diloco_fp32.py, plain PyTorch; one fragment only), the baseline that splits a gap into codec and DiLoCo.


def method_spec(method):
    if not method.startswith("diloco-"):
        return METHODS[method]
    options = {"h": 100, "lr": 0.7, "m": 0.9, "f": 1, "ilr": 0.0}
    codec = "q4"
    for token in method.split("-")[1:]:
        if token in ("q4", "q2", "none"):
            codec = token
            continue
        key = next((k for k in ("ilr", "lr", "h", "m", "f") if token.startswith(k)), None)
        if key is None:
            raise SystemExit(f"{method}: unknown DiLoCo setting {token!r} (h, lr, m, f, ilr, q2, q4, none)")
        options[key] = type(options[key])(token[len(key):])
    return {"codec": codec, "diloco": options}, None
# The learning rates of plain SGD under momentum correction.
DGC_LR = {"sgd-dgc": 0.1, "sgd-dgc-tuned": 0.3}
TASKS = {
    # task: (default methods, optimizer, steps)
    "lm": (("dense", "q4", "topk", "topk-warmup", "topk-warmup-long", "topk-clip", "topk-warmup-clip",
            "topk-q4warmup", "topk-q4warmup-long"), "adamw", 400),
    "digits": (("dense", "q4", "topk", "topk-warmup", "topk-dgc", "topk-dgc-tuned"), "sgd-momentum", 600),
    "lm2": (("dense", "diloco-h20", "diloco-h20-lr1.0-m0.3"), "adamw-gpt", 300),
}


def make_codec(spec, ratio):
    import gradcomp

    if spec is None:
        return None
    kw = dict(spec)
    kw.pop("diloco", None)
    kw.pop("params", None)
    kw.pop("weight_block", None)
    kind = kw.pop("codec")
    if kind == "q2":
        return gradcomp.Q2()
    if kind == "none":
        return gradcomp.NoCompression()
    return gradcomp.Q4() if kind == "q4" else gradcomp.TopK(ratio=ratio, **kw)


# ---- the language model --------------------------------------------------------------------

def corpus():
    """Bytes of English prose (documentation topics), as int64 tokens < 128, train and held out."""
    import torch
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.int64)
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def make_lm(seq, vocab=128, d=128, layers=4, heads=4):
    import torch
    import torch.nn as nn

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x):
            h = self.tok(x) + self.pos[: x.shape[1]]
            h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    return CharLM()


def lm_batch(data, rank, step, batch, seq, seed):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    x = torch.stack([data[s:s + seq] for s in starts])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
    return x, y


# ---- one rank of one run ---------------------------------------------------------------------

def run_rank(rank, world, store, task, method, seed, steps, ratio, out, warm_start=0, eval_every=0):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import gradcomp.torch as gt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    spec, opt_override = method_spec(method)
    opt_kind = opt_override or TASKS[task][1]
    torch.manual_seed(seed)
    vocab = 256 if task == "lm2" else 128
    if task == "lm":
        seq, batch = 64, 16
        train_data, val_data = corpus()
        model = make_lm(seq)
    elif task == "lm2":
        seq, batch = 64, 16
        train_data, val_data = lm2_corpus()
        model = make_lm2(seq)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        xs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        ys = torch.tensor(digits.target, dtype=torch.int64)
        perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(1234))
        train_x, train_y = xs[perm[:1500]], ys[perm[:1500]]
        val_x, val_y = xs[perm[1500:]], ys[perm[1500:]]
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    fsdp = method.startswith("fsdp")
    diloco = (spec or {}).get("diloco")
    if diloco and not warm_start:
        ddp = model  # each rank trains alone between the outer rounds
    elif fsdp:
        from torch.distributed.fsdp import fully_shard

        layers = {"lm": lambda: model.blocks.layers, "lm2": lambda: model.blocks}.get(
            task, lambda: [m for m in model if isinstance(m, nn.Linear)])()
        for layer in layers:
            fully_shard(layer)
        ddp = fully_shard(model)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    if opt_kind == "adamw-gpt":
        opt = lm2_optimizer(ddp.parameters(), (diloco or {}).get("ilr"))
    elif opt_kind == "adamw":
        opt = torch.optim.AdamW(ddp.parameters(), lr=(diloco or {}).get("ilr") or 2e-3, weight_decay=0.01)
    elif opt_kind in DGC_LR:
        opt = torch.optim.SGD(ddp.parameters(), lr=DGC_LR[opt_kind], momentum=0.0)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    codec = make_codec(spec, ratio)

    def attach():
        if codec is None:
            return None
        if diloco and spec["codec"] == "none":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from diloco_fp32 import Fp32DiLoCo

            if diloco["f"] != 1:
                raise SystemExit(f"{method}: the uncompressed DiLoCo baseline has one fragment only")
            return Fp32DiLoCo(model.parameters(), opt, diloco["h"], diloco["lr"], diloco["m"], diloco["m"] > 0)
        if diloco:
            return gt.diloco(model, opt, codec, inner_steps=diloco["h"], outer_lr=diloco["lr"],
                             outer_momentum=diloco["m"], nesterov=diloco["m"] > 0, fragments=diloco["f"])
        if fsdp:
            import gradcomp

            hook = gt.fsdp(model, codec, params=gradcomp.Int8() if (spec or {}).get("params") == "int8" else None)
            if (spec or {}).get("params") == "w4":
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                import weight_q4

                weight_q4.install(model, spec["weight_block"])
            return hook
        return gt.register(ddp, codec, optimizer=opt)

    # With a warm start DiLoCo attaches after warm_start dense DDP steps (a dense checkpoint of the same run, with
    # its AdamW moments and its place in the schedule); main() refuses it for the per-step codecs.
    hook = None if diloco and warm_start else attach()

    def evaluate():
        with torch.no_grad():
            model.eval()
            if task in ("lm", "lm2"):
                vals = []
                for j in range(16):  # the same held-out windows for every method
                    x, y = lm_batch(val_data, 0, 10_000 + j, 32, 64, 0)
                    vals.append(F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).item())
                result = {"val_loss": statistics.mean(vals)}
            else:
                logits = model(val_x)
                result = {"val_loss": F.cross_entropy(logits, val_y).item(),
                          "accuracy": (logits.argmax(1) == val_y).float().mean().item()}
            model.train()
            return result

    def rank_spread():
        """The largest difference of a parameter between ranks (0 while DDP keeps them identical)."""
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        high, low = flat.clone(), flat.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        return (high - low).max().item()

    spread = {}
    curve = []  # (steps done, held-out loss) every eval_every steps, on rank 0
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses = []
    times = []  # wall time at the end of each step
    t0 = time.perf_counter()
    for step in range(steps):
        if warm_start and step == warm_start:
            spread["before_switch"] = rank_spread()
            if diloco:
                hook = attach()
                ddp = model  # from here each rank trains alone: DDP's reducer acts only after a forward through it
        if warm_start and step == warm_start + (max(1, diloco["h"] // 2) if diloco else 1):  # DiLoCo: mid-round
            spread["after_switch"] = rank_spread()
        if task in ("lm", "lm2"):
            x, y = lm_batch(train_data, rank, step, batch, seq, seed)
            loss = F.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
        else:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
            idx = torch.randint(0, len(train_x), (32,), generator=g)
            loss = F.cross_entropy(ddp(train_x[idx]), train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
        if eval_every and (step + 1) % eval_every == 0 and rank == 0:
            curve.append((step + 1, evaluate()["val_loss"]))
    seconds = time.perf_counter() - t0
    final = evaluate()
    stats = hook.stats() if diloco else hook.stats()["total"] if hook is not None else None
    params = sum(p.numel() for p in model.parameters())
    # Without a hook: what DDP's ring allreduce of the fp32 gradients sends per rank, or FSDP's
    # reduce-scatter (half of it; both FSDP methods also all-gather the parameters alike).
    dense_bytes = (1 if fsdp else 2) * (world - 1) / world * 4 * params
    # DiLoCo after a warm start: bytes per step of its own phase (the dense phase sent dense's).
    method_steps = steps - warm_start if diloco else steps
    result = {"task": task, "method": method, "seed": seed, "steps": steps, "losses": losses, "times": times,
              "seconds": seconds, **final, "params": params,
              "bytes_per_step": stats["bytes_sent"] / method_steps if stats else dense_bytes}
    if warm_start:
        result.update(warm_start=warm_start, rank_spread=spread)
    if eval_every:
        result["val_curve"] = curve
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _entry(*args):
    try:
        run_rank(*args)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


def run(task, method, seed, steps, ratio, world, warm_start=0, eval_every=0):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), task, method, seed,
                                                  steps, ratio, out, warm_start, eval_every))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=1800)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{task}/{method}/seed {seed} failed: exit codes {[p.exitcode for p in procs]}")
        with open(out) as f:
            return json.load(f)


def summarize(results):
    rows = {}
    for r in results:
        rows.setdefault((r["task"], r["method"]), []).append(r)
    table = []
    for (task, method), rs in rows.items():
        baseline = "fsdp-dense" if method.startswith("fsdp") else "dense"
        dense = [x for x in results if x["task"] == task and x["method"] == baseline]
        base = statistics.mean(x["val_loss"] for x in dense) if dense else float("nan")
        loss = statistics.mean(x["val_loss"] for x in rs)
        row = {"task": task, "method": method, "seeds": len(rs), "val_loss": loss,
               "vs_dense": loss / base - 1, "bytes_per_step": rs[0]["bytes_per_step"],
               "seconds": statistics.median(x["seconds"] for x in rs)}
        if "accuracy" in rs[0]:
            row["accuracy"] = statistics.mean(x["accuracy"] for x in rs)
            row["accuracy_vs_dense"] = row["accuracy"] - statistics.mean(x["accuracy"] for x in dense)
        table.append(row)
    return table


def check_warm_start(results):
    """Every warm-started DiLoCo run followed dense exactly up to the switch (its loss there is dense's), with the
    ranks identical, and trained alone after it; dense's ranks stayed identical. Raises otherwise."""
    checked = []
    for r in results:
        if not r.get("warm_start"):
            continue
        n, spread = r["warm_start"], r["rank_spread"]
        name = f"{r['task']}/{r['method']}/seed {r['seed']}"
        assert spread["before_switch"] == 0.0, f"{name}: ranks differ before the switch: {spread}"
        if not r["method"].startswith("diloco-"):
            assert spread.get("after_switch", 0.0) == 0.0, f"{name}: dense ranks differ: {spread}"
            continue
        assert spread.get("after_switch", 1.0) > 0.0, f"{name}: ranks identical mid-round after the switch: {spread}"
        dense = [d for d in results if d["method"] == "dense" and (d["task"], d["seed"], d["steps"]) ==
                 (r["task"], r["seed"], r["steps"])]
        if dense:
            assert r["losses"][:n + 1] == dense[0]["losses"][:n + 1], \
                f"{name}: the losses up to the switch (step {n}) are not dense's"
            assert r["losses"][n + 1:] != dense[0]["losses"][n + 1:], f"{name}: the losses after the switch are dense's"
            checked.append(f"{name} (loss at the switch {r['losses'][n]:.4f} = dense's)")
    if checked:
        print("warm-start check: " + "; ".join(checked))


def print_table(table):
    print(f"{'task':7} {'method':17} {'seeds':>5} {'val loss':>9} {'vs dense':>9} {'accuracy':>9} "
          f"{'bytes/step':>11}")
    for r in table:
        acc = f"{100 * r['accuracy']:8.2f}%" if "accuracy" in r else " " * 9
        print(f"{r['task']:7} {r['method']:17} {r['seeds']:5d} {r['val_loss']:9.4f} {100 * r['vs_dense']:+8.2f}% "
              f"{acc} {r['bytes_per_step'] / 1e3:10.1f}k")


def plot(results, path, wall_time=False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        methods = []
        for r in results:
            if r["task"] == task and r["method"] not in methods:
                methods.append(r["method"])
        for method in methods:
            runs = [r for r in results if r["task"] == task and r["method"] == method]
            curves = [r["losses"] for r in runs]
            mean = [statistics.mean(c[i] for c in curves) for i in range(len(curves[0]))]
            window = max(1, len(mean) // 40)
            smooth = [statistics.mean(mean[max(0, i - window):i + 1]) for i in range(len(mean))]
            if wall_time and all("times" in r for r in runs):
                ax.plot([statistics.mean(r["times"][i] for r in runs) for i in range(len(smooth))], smooth,
                        label=method)
            else:
                ax.plot(smooth, label=method)
        ax.set_title(f"{task}: training loss (mean over seeds, smoothed)" + (" against wall time" if wall_time else ""))
        ax.set_xlabel("wall time (s)" if wall_time else "step")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="lm,digits")
    p.add_argument("--methods", default="", help="comma list (default: each task's own)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="0: each task's default")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                   help="DiLoCo methods: dense DDP for STEPS steps, then DiLoCo (a dense checkpoint of the same run); "
                        "dense is unchanged, its runs check the ranks stay identical")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="also the held-out loss after every N-th step (the curve: with a warm start and N = H, "
                        "every DiLoCo round's end)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default="bench/results/convergence")
    p.add_argument("--merge", default="", help="an earlier convergence.json whose runs of other methods join the table")
    p.add_argument("--gbps", type=float, default=0.0,
                   help="run the ranks in a private network namespace whose loopback carries this many Gbit/s "
                        "per rank (bench/e2e.py's link); the plot is then against wall time")
    p.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="CI: the LM for 150 steps, one seed, dense/topk/topk-warmup-clip/topk-q4warmup-100; asserts the "
                        "remedies beat plain EF")
    a = p.parse_args()
    if a.gbps > 0 and not a.in_namespace:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from e2e import Link

        link = Link()
        try:
            if not link.set_rate(a.gbps * a.world):
                raise SystemExit(f"--gbps needs a rate-limited network namespace: {link.note}")
            raise SystemExit(subprocess.call(link.prefix + [sys.executable, os.path.abspath(__file__)] + sys.argv[1:]
                                             + ["--in-namespace"]))
        finally:
            link.close()
    if a.quick:
        a.tasks, a.methods, a.seeds, a.steps = "lm", "dense,topk,topk-warmup-clip,topk-q4warmup-100", "0", 150
    if a.warm_start:
        odd = [m for m in (a.methods.split(",") if a.methods else []) if m != "dense" and not m.startswith("diloco-")]
        if odd or not a.methods:
            raise SystemExit(f"--warm-start applies to dense and diloco-* methods only, got {odd or 'the defaults'}")
    os.makedirs(a.out, exist_ok=True)
    corpora = {}
    if "lm2" in a.tasks.split(","):
        text, digest = lm2_corpus_bytes()  # raises on the measured Python if the bytes are not the docstring's
        corpora["lm2"] = {"bytes": len(text), "sha256": digest, "python": platform.python_version()}
        print(f"lm2 corpus: {len(text)} bytes, sha256 {digest} (Python {platform.python_version()}; "
              f"{'.'.join(map(str, LM2_CORPUS_PYTHON))} measured {LM2_CORPUS_BYTES} bytes)", flush=True)
    results = []
    for task in a.tasks.split(","):
        methods = a.methods.split(",") if a.methods else TASKS[task][0]
        steps = a.steps or TASKS[task][2]
        for method in methods:
            for seed in [int(s) for s in a.seeds.split(",")]:
                if a.warm_start >= steps:
                    raise SystemExit(f"--warm-start {a.warm_start} must be below the run's {steps} steps")
                r = run(task, method, seed, steps, a.ratio, a.world, a.warm_start, a.eval_every)
                print(f"{task}/{method}/seed {seed}: val loss {r['val_loss']:.4f} in {r['seconds']:.0f} s", flush=True)
                results.append(r)
                with open(os.path.join(a.out, "runs.jsonl"), "a") as f:  # each run as it ends, for long runs
                    f.write(json.dumps(r) + "\n")
    if a.merge:
        with open(a.merge) as f:
            earlier = json.load(f)["runs"]
        fresh = {(r["task"], r["method"]) for r in results}
        results = [r for r in earlier if (r["task"], r["method"]) not in fresh] + results
    table = summarize(results)
    print_table(table)
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "world": a.world, "ratio": a.ratio, "gbps_per_rank": a.gbps or None,
            "warm_start": a.warm_start or None, "argv": sys.argv[1:], "corpora": corpora or None}
    with open(os.path.join(a.out, "convergence.json"), "w") as f:
        json.dump({"meta": meta, "table": table, "runs": results}, f)
    plot(results, os.path.join(a.out, "convergence.png"), wall_time=a.gbps > 0)
    check_warm_start(results)
    if a.quick:
        by = {r["method"]: r["val_loss"] for r in table}
        for remedy in ("topk-warmup-clip", "topk-q4warmup-100"):
            assert by[remedy] < by["topk"], f"{remedy} did not beat plain error feedback: {by}"
        print("quick check: top-k with warm-up and clipping, and with a q4 warm-up, beat plain error feedback")


if __name__ == "__main__":
    main()

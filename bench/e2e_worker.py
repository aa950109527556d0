"""One rank of the end-to-end benchmark (started by bench/e2e.py): DDP training with one method."""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("ddp-fp32", "bf16-hook", "powersgd-r4", "quant-pertensor", "gradcomp-q4", "gradcomp-topk",
           "gradcomp-q4-hier", "gradcomp-topk-hier", "gradcomp-q4-1piece", "gradcomp-q4-hier-1piece",
           "gradcomp-topk-sequential", "fsdp-fp32", "fsdp-bf16", "fsdp-bf16-mp", "fsdp-gradcomp-q4",
           "fsdp-gradcomp-q4-int8", "fsdp-gradcomp-q4-int4", "hsdp-fp32", "hsdp-bf16-mp", "hsdp-gradcomp-q4-int8",
           "fp8-hook",
           "diloco-q4-h20", "diloco-q4-h100", "diloco-q4-h20-tau5", "diloco-q4-h20-tau10", "diloco-q4-h20-tau15",
           "diloco-q2-h100-tau80", "gradcomp-topk-dgc")
# Top-k with momentum correction trains digits with SGD without momentum at 3x the lr
# (docs/benchmarks.md's recommended setting for SGD).
DGC_LR_SCALE = 3.0
# FSDP2 (fully_shard on every Linear and the root, default resharding): its own reduce-scatter in
# fp32 or in bf16 (MixedPrecisionPolicy's reduce_dtype; parameters stay fp32); bf16 mixed precision as
# users run it (param_dtype = reduce_dtype = bf16), timed as bf16 on the wire with fp32 compute because
# this CPU has no bf16 arithmetic (bench/fsdp_bf16_wire.py); gradcomp's q4 reduce-scatter, alone or
# with int8 weight all-gathers. The hsdp-* ones: the same over two nodes (bench/e2e_nodes.py), sharded
# inside a node and replicated across nodes.
FSDP_METHODS = ("fsdp-fp32", "fsdp-bf16", "fsdp-bf16-mp", "fsdp-gradcomp-q4", "fsdp-gradcomp-q4-int8",
                "fsdp-gradcomp-q4-int4")
HSDP_METHODS = ("hsdp-fp32", "hsdp-bf16-mp", "hsdp-gradcomp-q4-int8")
# DiLoCo (gradcomp.torch.diloco): no DDP; every H steps the q4 outer gradient. Its step time is the
# mean over whole rounds (the median would hide the round). -tau<k>: overlap_steps = k, the round in the
# background and merged k inner steps after its sync point (mixing 0, not eager). diloco-q2-*: Q2 outer gradients.
DILOCO_METHODS = {"diloco-q4-h20": (20, 0), "diloco-q4-h100": (100, 0), "diloco-q4-h20-tau5": (20, 5),
                  "diloco-q4-h20-tau10": (20, 10), "diloco-q4-h20-tau15": (20, 15), "diloco-q2-h100-tau80": (100, 80)}
# The quantization hook issues Gloo collectives from future callbacks on another thread; with
# several buckets the ranks' collective order then diverges and Gloo aborts ("Received data size
# doesn't match"). It runs with one bucket so that it runs at all; PowerSGD, which does the same,
# gets a process group per bucket index instead (bench/powersgd_buckets.py).
SINGLE_BUCKET = ("quant-pertensor",)


# NCCL on GPUs when present (one GPU per rank), Gloo on CPU otherwise.
DEVICE = torch.device("cpu")


def make_ddp(model, method, bucket_cap_mb=25.0):
    cap = 100000 if method in SINGLE_BUCKET else bucket_cap_mb
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)


def prepare(model, method, gt, gradcomp, bucket_cap_mb=25.0, local_world_size=1):
    """The model wrapped for `method` (DDP, or fully_shard for the fsdp-* ones) and its gradcomp hook
    (DiLoCo's comes with the optimizer: attach_diloco)."""
    if method in DILOCO_METHODS:
        return model, None
    if method in FSDP_METHODS:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if method == "fsdp-bf16" else MixedPrecisionPolicy()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        if method == "fsdp-bf16-mp":
            from fsdp_bf16_wire import install_bf16_wire
            install_bf16_wire(model)
            return model, None
        if method == "fsdp-gradcomp-q4":
            return model, gt.fsdp(model, gradcomp.Q4())
        if method == "fsdp-gradcomp-q4-int8":
            return model, gt.fsdp(model, gradcomp.Q4(), params=gradcomp.Int8())
        if method == "fsdp-gradcomp-q4-int4":  # 4-bit weights (gradcomp.Int4, blocks of 32)
            return model, gt.fsdp(model, gradcomp.Q4(), params=gradcomp.Int4())
        return model, None
    if method in HSDP_METHODS:
        return prepare_hsdp(model, method, gt, gradcomp, local_world_size)
    ddp = make_ddp(model, method, bucket_cap_mb)
    return ddp, install(method, ddp, gt, gradcomp, local_world_size)


def prepare_hsdp(model, method, gt, gradcomp, local_world_size):
    """HSDP over (nodes, ranks per node): hsdp-fp32 is fully_shard over the 2-D mesh (reduce-scatter
    inside the node, FSDP's fp32 all-reduce across nodes); the others shard over the node's ranks and
    all-reduce each reduced shard across nodes through a hook: in bf16 (hsdp-bf16-mp, with bf16 weight
    all-gathers and reduce-scatters inside the node, fp32 compute) or gradcomp's q4 with int8 weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if local_world_size < 2 or world % local_world_size or world == local_world_size:
        raise ValueError(f"{method} needs two or more nodes of two or more ranks (--local-world-size), got "
                         f"{world} ranks of {local_world_size} per node")
    mesh = init_device_mesh("cpu", (world // local_world_size, local_world_size),
                            mesh_dim_names=("replicate", "shard"))
    over = mesh if method == "hsdp-fp32" else mesh["shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=over)
    fully_shard(model, mesh=over)
    if method == "hsdp-fp32":
        return model, None
    replicas = mesh["replicate"].get_group()
    if method == "hsdp-gradcomp-q4-int8":
        return model, gt.fsdp(model, gradcomp.Q4(), params=gradcomp.Int8(), replicate_group=replicas)
    from fsdp_bf16_wire import install_bf16_wire, bf16_replica_allreduce
    install_bf16_wire(model)
    for m in model.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(lambda t, group=replicas: bf16_replica_allreduce(t, group))
    return model, None


def attach_diloco(method, model, opt, gt, gradcomp):
    if method not in DILOCO_METHODS:
        return None
    inner_steps, overlap_steps = DILOCO_METHODS[method]
    codec = gradcomp.Q2() if method.startswith("diloco-q2") else gradcomp.Q4()
    return gt.diloco(model, opt, codec, inner_steps=inner_steps, overlap_steps=overlap_steps)


def tx_bytes(iface: str = "lo") -> int:
    """Bytes sent over an interface of this network namespace so far (all its ranks share it)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    return 0


def install(method: str, ddp, gt, gradcomp, local_world_size=1):
    """Registers the method's hook; returns the gradcomp hook handle or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks

    if method == "ddp-fp32":
        return None
    if method == "bf16-hook":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif method == "powersgd-r4":
        from powersgd_buckets import register_powersgd_per_bucket
        register_powersgd_per_bucket(ddp, rank=4, start_iter=2)
    elif method == "quant-pertensor":
        ddp.register_comm_hook(None, quantization_hooks.quantization_pertensor_hook)
    elif method == "fp8-hook":  # 2026's FP8 hook of training frameworks (bench/fp8_hook.py)
        from fp8_hook import fp8_hook
        ddp.register_comm_hook(None, fp8_hook)
    elif method == "gradcomp-q4":
        return gt.register(ddp, gradcomp.Q4())
    elif method == "gradcomp-topk":
        return gt.register(ddp, gradcomp.TopK(ratio=0.01))
    elif method == "gradcomp-topk-dgc":  # momentum correction: the optimizer then has no momentum
        return gt.register(ddp, gradcomp.TopK(ratio=0.01, momentum=0.9))
    elif method == "gradcomp-q4-hier":
        return gt.register(ddp, gradcomp.Q4(), local_world_size=local_world_size)
    elif method == "gradcomp-q4-1piece":  # each bucket in one piece, one bucket after another
        return gt.register(ddp, gradcomp.Q4(piece_numel=0))
    elif method == "gradcomp-topk-sequential":  # top-k has no pieces: only the buckets' overlap is off
        return gt.register(ddp, gradcomp.TopK(ratio=0.01, piece_numel=0))
    elif method == "gradcomp-q4-hier-1piece":
        return gt.register(ddp, gradcomp.Q4(piece_numel=0), local_world_size=local_world_size)
    elif method == "gradcomp-topk-hier":
        return gt.register(ddp, gradcomp.TopK(ratio=0.01), local_world_size=local_world_size)
    else:
        raise ValueError(f"unknown method {method!r}")
    return None


def throughput(args, rank, world):
    import gradcomp
    import gradcomp.torch as gt

    torch.manual_seed(0)
    hidden = args.hidden
    model = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 1024))
    params = sum(p.numel() for p in model.parameters())
    model = model.to(DEVICE)
    ddp, hook = prepare(model, args.method, gt, gradcomp, args.bucket_cap_mb, args.local_world_size) \
        if world > 1 else (model, None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    if world > 1 and args.method in DILOCO_METHODS:
        hook = attach_diloco(args.method, model, opt, gt, gradcomp)
    x = torch.randn(args.batch, 1024, device=DEVICE)

    def step_once():
        with torch.profiler.record_function("step::forward"):
            opt.zero_grad()
            loss = ddp(x).square().mean()
        with torch.profiler.record_function("step::backward"):
            loss.backward()
        with torch.profiler.record_function("step::optimizer"):
            opt.step()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    times, codec, inter, weight_codec = [], [], [], []
    tx0 = cpu0 = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            tx0 = tx_bytes(args.iface)
            cpu0 = time.process_time()
        t0 = time.perf_counter()
        step_once()
        times.append(time.perf_counter() - t0)
        if hook is not None and step >= args.warmup and args.method not in DILOCO_METHODS:
            stats = hook.stats()
            s = stats["step"]  # the gradients' collectives; FSDP's int8 weights under "all_gather"
            codec.append(s["codec_seconds"])
            inter.append(s["inter_node_bytes"])
            if "all_gather" in stats:
                weight_codec.append(stats["all_gather"]["step"]["codec_seconds"])
    tx = tx_bytes(args.iface) - tx0
    # Every thread of the rank (the inner steps, gradcomp's, the transport's), over the timed steps.
    cpu_per_step = (time.process_time() - cpu0) / args.steps
    ranks_on_link = max(world, 1) if args.iface == "lo" else args.local_world_size
    timed = times[args.warmup:]
    result = {"params": params,
              "step_s": statistics.mean(timed) if args.method in DILOCO_METHODS else statistics.median(timed),
              "step_times": times[args.warmup:],
              # Loopback: every rank's traffic; a node's link: what left the node.
              "bytes_per_step_per_rank": tx / args.steps / ranks_on_link,
              "link_bytes_per_step": tx / args.steps, "link": args.iface,
              "hook_inter_node_bytes": statistics.median(inter) if inter else None,
              "codec_s": statistics.median(codec) if codec else None,
              "weight_codec_s": statistics.median(weight_codec) if weight_codec else None,
              "cpu_s_per_step": cpu_per_step}
    if args.method in DILOCO_METHODS and hook is not None:
        # The exposed communication (steps waiting for a round) against the rounds' own time, whole run.
        st = hook.stats()
        # seconds: the caller's share (sync points and merges, waits included).
        result["diloco"] = {k: st.get(k) for k in ("rounds", "seconds", "wait_seconds", "background_seconds")}
    if args.trace:
        # One more step under the profiler: the timeline of forward, backward, every bucket's
        # encode, collectives and decode, and the optimizer (bench/timeline.py reads it).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step_once()
        prof.export_chrome_trace(f"{args.trace}.rank{rank}.json")
    return result


def digits(args, rank, world):
    import gradcomp
    import gradcomp.torch as gt
    import ddp_train

    xtr, ytr, xte, yte = ddp_train.digits_split()
    xtr, ytr = xtr[rank::world], ytr[rank::world]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ddp, _ = prepare(model, args.method, gt, gradcomp, local_world_size=args.local_world_size)
    if args.method == "gradcomp-topk-dgc":  # the momentum is the hook's
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05 * DGC_LR_SCALE, momentum=0.0)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    attach_diloco(args.method, model, opt, gt, gradcomp)
    gen = torch.Generator().manual_seed(1000 * rank)
    curve, start, steps_per_epoch = [], time.perf_counter(), len(ytr) // 32
    for epoch in range(args.epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(steps_per_epoch):
            idx = perm[i * 32:(i + 1) * 32]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(xte).argmax(dim=1) == yte).float().mean().item()
        curve.append((time.perf_counter() - start, acc))
    return {"curve": curve, "final_accuracy": curve[-1][1]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("throughput", "digits"), required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--master", default="127.0.0.1", help="address of rank 0's store")
    p.add_argument("--iface", default="lo", help="the interface whose sent bytes are counted")
    p.add_argument("--local-world-size", type=int, default=1, help="ranks per node (the -hier methods)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap, for every method")
    p.add_argument("--trace", default="", help="profile one more step into TRACE.rank<r>.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"ok": False}
    try:
        global DEVICE
        if torch.cuda.is_available() and torch.cuda.device_count() >= args.world:
            DEVICE = torch.device("cuda", args.rank)
            torch.cuda.set_device(DEVICE)
        if args.world > 1:
            store = dist.TCPStore(args.master, args.port, args.world, args.rank == 0,
                                  timeout=__import__("datetime").timedelta(seconds=120))
            dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", store=store, rank=args.rank,
                                    world_size=args.world, timeout=__import__("datetime").timedelta(seconds=120))
        fn = throughput if args.mode == "throughput" else digits
        result = {"ok": True, **fn(args, args.rank, args.world)}
    except Exception as e:  # the table reports the failure instead of dropping the row
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  "traceback": traceback.format_exc()[-2000:]}
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    main()

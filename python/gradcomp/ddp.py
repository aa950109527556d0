"""PyTorch DDP integration: gradcomp as a DistributedDataParallel communication hook.

Users reach it as ``gradcomp.torch`` (that module re-exports this one). Two routes run the same
C++ code:

* ``hook = gradcomp.torch.register(ddp_model, gradcomp.Q4())`` installs a C++
  ``c10d::CommHookInterface`` on ``ddp_model.reducer``; CPU buckets are compressed on a worker
  thread without the GIL.
* ``ddp_model.register_comm_hook(gradcomp.torch.HookState(gradcomp.Q4()), gradcomp.torch.comm_hook)``
  is the standard Python hook route.
"""

import os
import threading
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _C
from ._torch_compat import guard_against_compiled_autograd
from .codecs import NoCompression, Q4, TopK, refuse_q2

__all__ = ["register", "Hook", "HookState", "comm_hook", "check_optimizer", "node_groups"]


def _worker_cpus(worker_cpus) -> str:
    """"auto", "inherit", "0,2-3" or a list of CPU numbers, as the engine's CPU list string."""
    if isinstance(worker_cpus, str):
        try:
            _C.check_worker_cpus(worker_cpus)
        except RuntimeError as e:
            raise ValueError(str(e).splitlines()[0]) from None
        return worker_cpus
    if isinstance(worker_cpus, (list, tuple, set, frozenset, range)) and worker_cpus and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in worker_cpus):
        return ",".join(str(c) for c in sorted(worker_cpus))
    raise ValueError(f"worker_cpus must be 'auto', 'inherit', a CPU list such as '0,2-3' or a non-empty "
                     f"list of CPU numbers, got {worker_cpus!r}")


def _options(codec, timeout=None, fault=None, worker_cpus="auto") -> dict:
    codec = Q4() if codec is None else codec
    refuse_q2(codec, "the DDP hook")
    if not isinstance(codec, (Q4, TopK, NoCompression)):
        raise ValueError(f"codec must be gradcomp.Q4, gradcomp.TopK or gradcomp.NoCompression, got {codec!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                    and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return {**codec._options(), "timeout": timeout, "fault": fault, "worker_cpus": _worker_cpus(worker_cpus)}


_STATE_KEYS = {"format": int, "seed": int, "step": int, "started": bool, "residuals": dict,
               "chunk_residuals": dict}


def _check_state_dict(sd) -> None:
    """Refuses a malformed state dict as a whole, naming what is wrong, before any of it is used
    (the native side then checks sizes against the saved layouts and the world size)."""
    if not isinstance(sd, dict):
        raise ValueError(f"gradcomp state_dict must be a dict, got {type(sd).__name__}")
    for key, kind in _STATE_KEYS.items():
        if key not in sd:
            raise ValueError(f"gradcomp state_dict has no {key!r}")
        if not isinstance(sd[key], kind) or (kind is int and isinstance(sd[key], bool)):
            raise ValueError(f"gradcomp state_dict[{key!r}] must be {kind.__name__}, got {type(sd[key]).__name__}")
    if sd["format"] != 1:
        raise ValueError(f"gradcomp state_dict format {sd['format']} is not supported (expected 1)")
    if not 0 <= sd["seed"] < 2**64 or not 0 <= sd["step"] < 2**32:
        raise ValueError(f"gradcomp state_dict seed {sd['seed']} or step {sd['step']} is out of range")
    for key in ("world_size", "local_world_size"):
        if not isinstance(sd.get(key, 0), int) or isinstance(sd.get(key, 0), bool) or sd.get(key, 0) < 0:
            raise ValueError(f"gradcomp state_dict {key} {sd.get(key)!r} is not a rank count")
    if not isinstance(sd.get("velocities", {}), dict):
        raise ValueError(f"gradcomp state_dict['velocities'] must be a dict, got {type(sd['velocities']).__name__}")
    for key in ("residuals", "chunk_residuals", "velocities"):
        for bucket, tensor in sd.get(key, {}).items():
            if not isinstance(bucket, int) or not 0 <= bucket < 2**64:
                raise ValueError(f"gradcomp state_dict[{key!r}] has a bucket key {bucket!r}, not a bucket identity")
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise ValueError(f"gradcomp state_dict[{key!r}][{bucket}] must be a 1-D uint8 tensor, got "
                                 f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    layouts = sd.get("layouts", {})
    if not isinstance(layouts, dict):
        raise ValueError(f"gradcomp state_dict['layouts'] must be a dict, got {type(layouts).__name__}")
    for bucket, layout in layouts.items():
        if not isinstance(bucket, int) or not 0 <= bucket < 2**64:
            raise ValueError(f"gradcomp state_dict['layouts'] has a bucket key {bucket!r}, not a bucket identity")
        ok = (isinstance(layout, dict) and isinstance(layout.get("index"), int) and layout.get("dtype") in (0, 1, 2)
              and isinstance(layout.get("params"), list)
              and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and v >= 0 for v in p)
                      for p in layout["params"]))
        if not ok:
            raise ValueError(f"gradcomp state_dict['layouts'][{bucket!r}] is not a bucket layout: {layout!r}")


def node_groups(process_group=None, local_world_size=None):
    """The process groups of a hierarchical reduction: ``(intra_node, inter_node)`` for
    ``local_world_size`` ranks per node, or ``(None, None)`` for the flat scheme.

    Ranks are node-major, as torchrun and srun number them: rank = node * L + local rank. ``None``
    takes the launcher's ranks per node (torchrun's ``LOCAL_WORLD_SIZE``, Slurm's tasks per node)
    when the job spans more than one node, and the flat scheme otherwise. Every rank of the
    default group must call it (it creates process groups).
    """
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    world = group.size()
    whole = world == dist.get_world_size()
    if local_world_size is None:  # the launcher's ranks per node (torchrun's or Slurm's)
        try:
            launched = _C.launch_env()["local_world_size"]
        except RuntimeError:  # no launcher's environment: one node
            launched = 1
        # Only the whole job is node-major in the launcher's numbering: a subgroup (DiLoCo across
        # nodes beside DDP inside them) split by LOCAL_WORLD_SIZE would pair ranks of different nodes.
        local_world_size = launched if whole and 0 < launched < world else 1
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size must be a positive number of ranks per node, got {local_world_size!r}")
    if world % local_world_size != 0:
        raise ValueError(f"local_world_size {local_world_size} does not divide the world size {world}: "
                         f"every node must hold the same number of ranks")
    if local_world_size == 1:
        return None, None
    ranks = dist.get_process_group_ranks(group)
    nodes = world // local_world_size
    backend = dist.get_backend(group)  # the node groups move what the model's group moves
    intra_lists = [ranks[n * local_world_size:(n + 1) * local_world_size] for n in range(nodes)]
    inter_lists = [ranks[l::local_world_size] for l in range(local_world_size)]
    if not whole:
        # Creating a group is a collective of every rank of the job with the same ranks in the same
        # order; the ranks of other subgroups enumerate other lists, so every rank makes all of them.
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (intra_lists, inter_lists))
        me = dist.get_rank()
        intra = inter = None
        for kind in (0, 1):
            made = set()
            for lists in everyone:
                for members in lists[kind]:
                    if tuple(members) in made:
                        continue
                    made.add(tuple(members))
                    g = dist.new_group(members, backend=backend)
                    if me in members:
                        intra, inter = (g, inter) if kind == 0 else (intra, g)
        return intra, inter
    intra, _ = dist.new_subgroups_by_enumeration(intra_lists, backend=backend)
    inter, _ = dist.new_subgroups_by_enumeration(inter_lists, backend=backend)
    return intra, inter


_own_groups = {}  # the hooks' process group for each group they reduce over, made once


def _own_group(process_group=None):
    """A process group of the hooks' own over the ranks and backend of ``process_group``: a hook's
    collectives run on its threads, and on DDP's group they could interleave with DDP's own
    collectives (``find_unused_parameters``' allreduce) in a different order on each rank. One
    per group, shared by the hooks over it (a group's connections and threads stay until the
    job ends). Every rank of the default group must call it, alike.
    """
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    if group not in _own_groups:
        timeout = None  # the group's own (new_group's default is PyTorch's, not the job's)
        for device in ("cpu", "cuda"):
            try:
                timeout = group._get_backend(torch.device(device)).options._timeout
                break
            except (RuntimeError, AttributeError, ValueError):
                continue
        _own_groups[group] = dist.new_group(ranks=dist.get_process_group_ranks(group),
                                            backend=dist.get_backend(group), timeout=timeout)
    return _own_groups[group]


def _node_transport(intra, node_transport):
    """The shared-memory name the node's ranks exchange through on the CPU ("" for the intra-node
    process group). Local rank 0 draws a job-unique name and sends it to its node."""
    if node_transport not in ("shm", "group"):
        raise ValueError(f"node_transport must be 'shm' or 'group', got {node_transport!r}")
    if intra is None or node_transport == "group":
        return ""
    name = [f"/gradcomp-{os.getpid()}-{os.urandom(8).hex()}" if dist.get_rank(intra) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(intra, 0), group=intra)
    return name[0]


def _codec_name(codec) -> str:
    return {"Q4": "q4", "TopK": "topk"}.get(type(codec).__name__, "none")


class Hook:
    """Handle to a registered hook: statistics and checkpointable state (one per rank)."""

    def __init__(self, native, codec):
        self._native = native
        self.codec = codec

    def stats(self) -> dict:
        """Bytes sent, uncompressed bytes, ratio, codec and communication seconds: for the last
        step ("step") and since registration ("total")."""
        return {"step": self._native.last_step_stats(), "total": self._native.total_stats()}

    def state_dict(self) -> dict:
        """This rank's residuals (by stable bucket identity), step counter and seed."""
        return self._native.state_dict()

    def metrics_text(self) -> str:
        """This rank's counters since registration in Prometheus's text format (gradcomp.torch.metrics
        serves them; docs/operations.md lists them)."""
        if self._native is None:
            self._ensure_native()
        rank = dist.get_rank() if dist.is_initialized() else 0
        return self._native.metrics_text(rank, _codec_name(self.codec))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores state saved by ``state_dict`` on the same rank; the run then continues
        bit-identically to one that never stopped. A malformed state, or one saved by a job of
        another world size, is refused as a whole with a ValueError or RuntimeError."""
        _check_state_dict(state_dict)
        self._native.load_state_dict(state_dict)

    @property
    def worker_cpus(self) -> list:
        """The CPUs the hook's worker thread (CPU buckets) may run on, once the first bucket has
        come; empty before, and for CUDA buckets (no worker thread)."""
        return [] if self._native is None else self._native.worker_cpus()

    @property
    def worker_placement(self) -> str:
        """How ``worker_cpus`` was chosen (``register(..., worker_cpus=...)``)."""
        return "" if self._native is None else self._native.worker_placement()


# Optimizers that scale each coordinate by its own running statistics (top-k's bursts break them).
ADAPTIVE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor")
    if hasattr(torch.optim, name))


def check_optimizer(optimizer: torch.optim.Optimizer, codec) -> None:
    """Raises ValueError when ``optimizer`` does not fit ``codec``'s contract; warns when top-k meets
    an adaptive optimizer (Adam and its kin: docs/benchmarks.md, "Top-k with Adam").

    ``TopK(momentum=m)`` (momentum correction) applies the momentum itself and hands the
    optimizer the sparse, momentum-corrected update: the optimizer must be ``torch.optim.SGD``
    with ``momentum=0`` in every parameter group (weight decay and learning-rate schedules are
    fine). Every other codec takes any optimizer.
    """
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        advice = _C.adaptive_optimizer_warning(codec._options())
        if advice:
            warnings.warn(f"gradcomp: {advice}", UserWarning, stacklevel=3)
    if not isinstance(codec, TopK) or codec.momentum == 0:
        return
    what = f"TopK(momentum={codec.momentum}) applies momentum itself (DGC's momentum correction)"
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"{what}: the optimizer must be torch.optim.SGD with momentum=0, got "
                         f"{type(optimizer).__name__} (for Adam-family optimizers use TopK without "
                         f"momentum; docs/algorithms.md)")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("momentum", 0) != 0 or group.get("nesterov", False):
            raise ValueError(f"{what}: optimizer param group {i} has momentum={group.get('momentum')} "
                             f"nesterov={group.get('nesterov')}; set momentum=0 (the hook's velocity "
                             f"replaces it)")


_REDUCER_NEEDED = ("gradcomp's hook runs inside DDP's C++ reducer, bucket by bucket; {what} replaces that "
                   "reducer, and DDP would then skip the hook or call it per parameter. Use torch.compile with "
                   "the default torch._dynamo.config.optimize_ddp ('ddp_optimizer'), which keeps the reducer and "
                   "the hook, and run backward without compiled autograd.")


def _ddp_module(model) -> torch.nn.parallel.DistributedDataParallel:
    """The DDP module of ``model``: itself, or the one ``torch.compile`` wrapped."""
    import torch._dynamo  # a DDP model has imported it already

    inner = model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model
    if not isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        what = type(model).__name__ if inner is model else f"torch.compile of a {type(inner).__name__}"
        raise TypeError(f"register expects a DistributedDataParallel model (or torch.compile of one), got {what}")
    return inner


def _check_reducer_kept(ddp_model=None) -> None:
    """Refuses the torch.compile modes that replace DDP's C++ reducer (docs/api.md, torch.compile):
    optimize_ddp="python_reducer" (for ``ddp_model``: the mode it was made in) and compiled
    autograd enabled now. Compiled autograd switched on by config only applies to backward calls
    inside a compiled function, where PyTorch itself raises at the reducer: a warning says so."""
    import torch._dynamo

    python_reducer = (getattr(ddp_model, "_use_python_reducer", False) if ddp_model is not None
                      else torch._dynamo.utils.get_optimize_ddp_mode() == "python_reducer")
    if python_reducer:
        raise RuntimeError(_REDUCER_NEEDED.format(what='torch._dynamo.config.optimize_ddp="python_reducer"'))
    if torch._dynamo.compiled_autograd.compiled_autograd_enabled:
        raise RuntimeError(_REDUCER_NEEDED.format(what="compiled autograd"))
    if torch._dynamo.config.compiled_autograd:
        warnings.warn("torch._dynamo.config.compiled_autograd is on: a backward inside a compiled function would "
                      "replace DDP's C++ reducer, which runs gradcomp's hook (PyTorch raises there). Call "
                      "backward outside compiled code, or turn compiled autograd off.", stacklevel=3)


def _guard(params) -> None:
    """Guards the first trained parameter against a backward under compiled autograd."""
    param = next((p for p in params if p.requires_grad), None)
    if param is not None:
        guard_against_compiled_autograd(param)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, codec=None, *, optimizer=None,
             timeout=None, local_world_size=None, node_transport="shm", worker_cpus="auto",
             _fault=None) -> Hook:
    """Installs gradcomp as ``ddp_model``'s communication hook (call before the first backward).

    ``ddp_model`` is the DDP module or ``torch.compile`` of it. The torch.compile modes that
    replace DDP's C++ reducer (``optimize_ddp="python_reducer"``, compiled autograd) are refused.

    ``codec`` defaults to ``gradcomp.Q4()``. DDP allows one hook per model. ``optimizer``, when
    given, is checked against the codec's contract (``check_optimizer``). ``timeout``: seconds
    one of the hook's collectives may take before it raises (default: the process group's
    timeout). ``local_world_size``: ranks per node for the hierarchical scheme (uncompressed
    inside a node, compressed between nodes; see ``node_groups``), 1 for the flat scheme.
    ``node_transport``: how a node's ranks exchange CPU buckets, "shm" (shared memory) or
    "group" (the intra-node Gloo group); CUDA buckets always use the intra-node group (NCCL).
    ``worker_cpus``: where the thread that compresses CPU buckets runs: "auto" (the CPUs of the
    thread that runs backward, unless OpenMP bound it to one core: then also the cores no
    thread is bound to), "inherit", or CPUs such as "6-7" or ``[6, 7]``.
    ``_fault`` is for gradcomp's own tests (a transport fault to inject).
    """
    ddp_model = _ddp_module(ddp_model)
    _check_reducer_kept(ddp_model)
    if optimizer is not None:
        check_optimizer(optimizer, Q4() if codec is None else codec)
    options = _options(codec, timeout, _fault, worker_cpus)
    intra, inter = node_groups(ddp_model.process_group, local_world_size)
    # CUDA buckets always use the intra-node group: no shared memory to name.
    on_cuda = any(p.is_cuda for p in ddp_model.parameters())
    shm_name = _node_transport(intra, "group" if on_cuda and node_transport == "shm" else node_transport)
    native = _C.DdpHook(_own_group(ddp_model.process_group), options, intra, inter, shm_name)
    # Buckets are recorded by parameter position, so a restart can reduce the saved layout.
    native.set_parameters(list(ddp_model.parameters()))
    _C.install_hook(ddp_model.reducer, native)
    global _hook_at_work
    _hook_at_work = True
    _guard(ddp_model.parameters())
    return Hook(native, Q4() if codec is None else codec)


class HookState(Hook):
    """State object for the standard route: ``ddp_model.register_comm_hook(state, comm_hook)``.

    It may be built before ``torch.distributed.init_process_group`` (as Lightning's
    ``DDPStrategy(ddp_comm_state=...)`` and every user of PyTorch's ``PowerSGDState`` build it);
    it then binds to the process group at its first bucket, or at ``state_dict`` /
    ``load_state_dict`` if those come first (both called on every rank alike). Until then
    ``metrics_text`` (a scrape) gives zero-valued metrics and ``stats`` raises; neither binds.
    """

    def __init__(self, codec=None, process_group=None, *, optimizer=None, timeout=None,
                 local_world_size=None, node_transport="shm", worker_cpus="auto", _fault=None):
        _check_reducer_kept()
        if optimizer is not None:
            check_optimizer(optimizer, Q4() if codec is None else codec)
        if node_transport not in ("shm", "group"):
            raise ValueError(f"node_transport must be 'shm' or 'group', got {node_transport!r}")
        self._options = _options(codec, timeout, _fault, worker_cpus)
        self._binding = (process_group, local_world_size, node_transport)
        self._group = None
        self._guarded = False
        # The native hook is made on first use, which may be a metrics scrape on the server's thread
        # while backward runs the hook: the lock makes exactly one.
        self._native_lock = threading.Lock()
        # Binding makes process groups (collectives): the lock makes them once if two threads of this
        # rank bind at once. It is held across those collectives, so a scrape never takes it (a
        # scrape of a state not yet bound answers zeros without it; _ensure_native takes the other lock).
        self._bind_lock = threading.Lock()
        super().__init__(None, Q4() if codec is None else codec)
        self._ran = False
        _expect_hook_by_first_step(self)
        if process_group is not None or dist.is_initialized():
            self._bind()  # made now, on the main thread, as before

    def _bind(self, on_cuda=False):
        """Creates the hook's process groups (collectives over every rank of the default group).

        Called from ``__init__`` when the process group exists, else from the first of: the first
        bucket (``comm_hook``), ``state_dict``, ``load_state_dict``. The first bucket is a point every
        rank reaches alike: DDP hands buckets to the hook in index order, so each rank's first call
        is bucket 0 of its first backward, after the same forward collectives (buffer broadcast)
        and the same asynchronous unused-parameter allreduce, which were enqueued before it on
        every rank. While it runs, the thread that called backward is inside backward on every
        rank (CPU: it is this thread; CUDA: it waits for the device threads), so no other
        collective or group creation of DDP's or the program's can come between, in a different
        order on different ranks; group creation counts groups globally, so that order is what
        must match. ``stats`` and ``metrics_text`` never bind: they are often called on one rank
        only (a scraper thread, rank 0's logging), and a group made there would hang the job.
        Before binding ``metrics_text`` answers zeros and ``stats`` raises.
        """
        if self._group is not None:
            return
        with self._bind_lock:
            if self._group is not None:  # another thread of this rank bound it meanwhile
                return
            if not dist.is_initialized():
                raise RuntimeError("gradcomp.torch.HookState: the default process group does not exist yet; call "
                                   "torch.distributed.init_process_group (or let the trainer do it) before the "
                                   "first backward, state_dict() or load_state_dict()")
            process_group, local_world_size, node_transport = self._binding
            nodes = node_groups(process_group, local_world_size)
            group = _own_group(process_group)
            # CUDA buckets always use the intra-node group (NCCL): no shared memory to name.
            self._shm_name = _node_transport(nodes[0], "group" if on_cuda else node_transport)
            self._nodes = nodes
            # Last: a scrape reads _group without a lock, and from a bound state makes the native hook
            # from _nodes and _shm_name.
            self._group = group

    def _ensure_native(self):
        if self._native is None:
            if self._group is None:
                raise RuntimeError("gradcomp.torch.HookState was built before the process group and has not seen a "
                                   "bucket yet: its statistics exist from the first backward on (or after "
                                   "state_dict()/load_state_dict() on every rank)")
            with self._native_lock:
                if self._native is None:
                    self._native = _C.DdpHook(self._group, self._options, *self._nodes, self._shm_name)
        return self._native

    def stats(self) -> dict:
        self._ensure_native()
        return super().stats()

    def metrics_text(self) -> str:
        """As ``Hook.metrics_text``; before the state is bound (built before the process group, no
        bucket yet) the same metrics, all zero. A scrape never binds: it runs on a server's thread, on
        one rank or at its own time, and binding is a collective of every rank (``_bind``)."""
        if self._group is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            return _C.zero_metrics_text(rank, _codec_name(self.codec), "ddp")
        return super().metrics_text()

    def state_dict(self) -> dict:
        self._bind()
        self._ensure_native()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._bind()
        self._ensure_native()
        super().load_state_dict(state_dict)


_hook_at_work = False  # some gradcomp DDP hook of this process was registered (register) or ran (comm_hook)


def _expect_hook_by_first_step(state: HookState) -> None:
    """After the first optimizer step of this process, raises if ``state``'s hook has not run: a state
    built and never handed to DDP (or dropped by a framework) would otherwise train uncompressed, silently."""
    ref = weakref.ref(state)  # a state the program dropped is not expected to run
    checked = []

    def check(optimizer, args, kwargs):
        # Not removed here (PyTorch iterates its hooks while calling them): a no-op after the first step, and
        # removed when the state goes.
        state = ref()
        if checked or state is None:
            return
        checked.append(True)
        # Any gradcomp hook at work in this process passes: with two models, one optimizer may step before the
        # other model's first backward (a dropped state beside a working one is not caught).
        if not state._ran and not _hook_at_work:
            raise RuntimeError(
                "gradcomp.torch.HookState was made, but by the end of the first optimizer step its hook had not run: "
                "the gradients were averaged uncompressed (or not at all). Hand it to the DDP model "
                "(ddp_model.register_comm_hook(state, gradcomp.torch.comm_hook)); PyTorch Lightning's "
                "DDPStrategy(ddp_comm_hook=...) registers hooks on CUDA only: use "
                "gradcomp.integrations.lightning.GradcompCallback, which works on CPU and CUDA")

    weakref.finalize(state, register_optimizer_step_post_hook(check).remove)


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages ``bucket`` over the ranks with gradcomp, in place."""
    if not isinstance(bucket, dist.GradBucket):  # DDP made under optimize_ddp="python_reducer"
        raise RuntimeError(_REDUCER_NEEDED.format(what='torch._dynamo.config.optimize_ddp="python_reducer"'))
    if state._group is None:  # built before the process group: binds here (HookState._bind says why it is safe)
        state._bind(on_cuda=bucket.buffer().is_cuda)
    native = state._ensure_native()
    global _hook_at_work
    state._ran = _hook_at_work = True
    if not state._guarded:  # from the first bucket on: the standard route sees no model before
        _guard(bucket.parameters())
        state._guarded = True
    shapes = [list(p.shape) for p in bucket.parameters()]
    # Queued as the registered hook queues it: the future completes when the bucket is averaged.
    # DDP's Python hooks must return a future of a Python object, hence the then(), as PyTorch's
    # own hooks do.
    reduced = native.submit_bucket(bucket.buffer(), bucket.index(), shapes, bucket.is_last())
    return reduced.then(lambda done: done.value())

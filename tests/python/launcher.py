"""Runs a function on W real processes joined by a Gloo process group, with a hard timeout."""
from __future__ import annotations

import datetime
import faulthandler
import importlib
import multiprocessing as mp
import os
import tempfile
import traceback


def _entry(module: str, fn: str, rank: int, world: int, store: str, args: tuple, queue,
           timeout: float = 180.0, env: dict | None = None) -> None:
    _use_environment(env)
    # A rank still running shortly before the test gives up prints every thread's stack: a hang
    # then says where it is (stderr reaches the test's report).
    faulthandler.dump_traceback_later(max(timeout - 15.0, 1.0), exit=False)
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        try:
            result = getattr(importlib.import_module(module), fn)(rank, world, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # reported to the test, which fails with the traceback
        queue.put((rank, "error", traceback.format_exc()))


def _entry_env(module: str, fn: str, rank: int, world: int, port: int, args: tuple, queue,
               timeout: float = 180.0, env: dict | None = None) -> None:
    _use_environment(env)
    # As torchrun starts a rank: the variables set, no process group yet (the program or its trainer makes it).
    faulthandler.dump_traceback_later(max(timeout - 15.0, 1.0), exit=False)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "GROUP_RANK": "0", "NODE_RANK": "0", "TORCHELASTIC_RUN_ID": "gradcomp-test"})
    try:
        import torch.distributed as dist

        try:
            result = getattr(importlib.import_module(module), fn)(rank, world, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # reported to the test, which fails with the traceback
        queue.put((rank, "error", traceback.format_exc()))


def _use_environment(env: dict | None) -> None:
    # A rank forked from the fork server starts with the server's environment: take the test's, as
    # it was when the rank was launched (monkeypatch.setenv and the like).
    if env is not None:
        os.environ.clear()
        os.environ.update(env)


# Ranks start from a fork server that has imported torch once (GRADCOMP_TEST_START=spawn or start="spawn":
# a fresh interpreter each). Importing torch costs each spawned rank about 2 s of CPU, which on a
# 2-core CI machine was a third of the Python tests' time. The rank gets the test's environment
# (above), but whatever the server's libraries read when torch was imported (OpenMP's OMP_*
# variables) is the server's: a test that sets those launches with start="spawn".
_fork_server = None


def _context(start: str):
    global _fork_server
    if start == "spawn" or os.environ.get("GRADCOMP_TEST_START") == "spawn":
        return mp.get_context("spawn")
    if _fork_server is None:
        _fork_server = mp.get_context("forkserver")
        _fork_server.set_forkserver_preload(["torch", "torch.distributed"])
    return _fork_server


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(module: str, fn: str, world: int, *args, timeout: float = 180.0, start: str = "forkserver") -> list:
    """As ``launch``, but each rank starts as under torchrun (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
    LOCAL_RANK set) without a process group: for code that makes it itself (trainers)."""
    return _run(_entry_env, _free_port(), module, fn, world, args, timeout, start)


def launch(module: str, fn: str, world: int, *args, timeout: float = 180.0, start: str = "forkserver") -> list:
    """Returns each rank's result; raises with every failing rank's traceback, or on a hang.
    start="spawn" starts each rank in a fresh interpreter (see _context)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _run(_entry, os.path.join(tmp, "store"), module, fn, world, args, timeout, start)


def _run(entry, where, module: str, fn: str, world: int, args: tuple, timeout: float, start: str) -> list:
    """Returns each rank's result; raises with every failing rank's traceback, or on a hang."""
    ctx = _context(start)
    queue = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=entry, args=(module, fn, r, world, where, args, queue, timeout, env))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    except Exception as e:  # queue.Empty: some rank hung
        errors.append(f"timed out after {timeout} s waiting for ranks {sorted(set(range(world)) - set(results))}: {e!r}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]

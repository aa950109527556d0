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
           timeout: float = 180.0) -> None:
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


def launch(module: str, fn: str, world: int, *args, timeout: float = 180.0) -> list:
    """Returns each rank's result; raises with every failing rank's traceback, or on a hang."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(module, fn, r, world, store, args, queue, timeout))
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

"""Process groups from the launcher's environment: torchrun's variables, or Slurm's when a job is
started by ``srun`` without torchrun (``gradcomp.torch.init_process_group``)."""
from __future__ import annotations

import os

import torch.distributed as dist

from . import _C

__all__ = ["launch_env", "init_process_group"]

_TORCHRUN_NAMES = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                   "local_world_size": "LOCAL_WORLD_SIZE", "master_addr": "MASTER_ADDR",
                   "master_port": "MASTER_PORT"}


def launch_env() -> dict:
    """This process's place in the job: ``rank``, ``world_size``, ``local_rank``,
    ``local_world_size``, ``master_addr``, ``master_port`` and ``launcher`` ("torchrun" or
    "slurm"), read by the same rules as the C++ ``gradcomp::launch_env``. Raises RuntimeError
    naming the variable that is missing or malformed."""
    return _C.launch_env()


def init_process_group(backend: str | None = None, **kwargs) -> dict:
    """``torch.distributed.init_process_group`` that also works under ``srun`` without torchrun:
    it puts the launch environment into torchrun's variables where they are unset (so that
    ``register(..., local_world_size=None)`` finds the ranks per node too) and initialises from
    them. ``kwargs`` go to ``init_process_group`` (``timeout``, ``device_id``, ...). Returns the
    launch environment."""
    env = launch_env()
    for key, name in _TORCHRUN_NAMES.items():
        os.environ.setdefault(name, str(env[key]))
    dist.init_process_group(backend, init_method="env://", rank=env["rank"], world_size=env["world_size"], **kwargs)
    return env

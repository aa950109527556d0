"""``gradcomp.torch``: the DDP hook, the FSDP2 reduce-scatter and DiLoCo under the name users import (implemented in
``gradcomp.ddp``, ``gradcomp.fsdp`` and ``gradcomp.diloco``)."""
from .ddp import Hook, HookState, check_optimizer, comm_hook, node_groups, register
from .diloco import DiLoCo, diloco
from .fsdp import FsdpHook, fsdp
from .launch import init_process_group, launch_env
from . import metrics

__all__ = ["register", "Hook", "HookState", "comm_hook", "check_optimizer", "node_groups", "init_process_group",
           "launch_env", "fsdp", "FsdpHook", "diloco", "DiLoCo", "metrics"]

"""``gradcomp.torch``: the DDP hook under the name users import (implemented in ``gradcomp.ddp``)."""
from .ddp import Hook, HookState, check_optimizer, comm_hook, node_groups, register

__all__ = ["register", "Hook", "HookState", "comm_hook", "check_optimizer", "node_groups"]

"""Hugging Face Accelerate: ``gradcomp.integrations.accelerate.register(accelerator, model, gradcomp.Q4())``
after ``accelerator.prepare`` (docs/integrations.md)."""
from . import attach, check_ran, gather_state, log_values, rank_state

__all__ = ["register", "CheckpointedHook"]

_WHERE = "gradcomp.integrations.accelerate.register"


class CheckpointedHook:
    """What ``accelerator.register_for_checkpointing`` saves: every rank's hook state (one file, written by
    the main process; Accelerate calls ``state_dict`` on every rank)."""

    def __init__(self, hook):
        self.hook = hook

    def state_dict(self):
        return gather_state(self.hook)

    def load_state_dict(self, state_dict):
        self.hook.load_state_dict(rank_state(state_dict, _WHERE))


def register(accelerator, model, codec=None, *, optimizer=None, **register_kwargs):
    """Compresses ``model``'s gradients (the DDP model ``accelerator.prepare`` returned) with ``codec``; the hook's
    state joins ``accelerator.save_state`` / ``load_state``. ``optimizer`` (the prepared one): checked against the
    codec, and after its first step gradcomp checks that its hook ran; each step logs ``gradcomp/bytes_per_step`` and
    ``gradcomp/ratio`` through ``accelerator.log`` (to the trackers the program started). Returns the hook."""
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch optimizer
    hook = attach(model, codec, optimizer=inner, where=_WHERE,
                  wrap_hint="Call it after model = accelerator.prepare(model) (or prepare(model, optimizer, ...)) "
                            "in a multi-process run.", **register_kwargs)
    accelerator.register_for_checkpointing(CheckpointedHook(hook))
    if inner is not None:
        checked = []

        def after_step(opt, args, kwargs):
            if not checked:
                check_ran(hook, _WHERE)
                checked.append(True)
            accelerator.log(log_values(hook))

        inner.register_step_post_hook(after_step)
    return hook

"""Hugging Face Trainer: ``trainer.add_callback(GradcompCallback(trainer, gradcomp.Q4()))`` (docs/integrations.md)."""
import os

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from . import attach, check_ran, log_values

__all__ = ["GradcompCallback"]

_WHERE = "gradcomp.integrations.transformers.GradcompCallback"


class GradcompCallback(TrainerCallback):
    """Compresses the Trainer's DDP gradients with ``codec``, saves each rank's hook state as
    ``gradcomp_state_{rank}.pt`` in each checkpoint folder (beside the Trainer's per-rank RNG states) and
    restores it on resume, and adds ``gradcomp/bytes_per_step`` and ``gradcomp/ratio`` to the Trainer's logs.

    It takes the trainer because the Trainer hands callbacks the unwrapped model (``model=trainer.model``),
    never the DDP wrapper (``trainer.model_wrapped``) whose buckets gradcomp compresses. ``resume_from``: the
    checkpoint folder when resuming from one outside ``args.output_dir`` (by default
    ``{output_dir}/checkpoint-{global_step}``, where the Trainer writes them and ``resume_from_checkpoint=True``
    finds them)."""

    def __init__(self, trainer, codec=None, *, resume_from=None, **register_kwargs):
        self.trainer, self.codec, self.register_kwargs = trainer, codec, register_kwargs
        self.resume_from = resume_from
        self.hook = None
        self._checked = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.hook = attach(self.trainer.model_wrapped, self.codec, optimizer=self.trainer.optimizer, where=_WHERE,
                           wrap_hint="Run the Trainer on several processes (torchrun / accelerate launch) with "
                                     "DDP, not FSDP or DeepSpeed.", **self.register_kwargs)
        if state.global_step > 0:  # resumed: the Trainer restored its own state at this step
            folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, f"gradcomp_state_{dist.get_rank()}.pt")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{_WHERE}: resuming at step {state.global_step}, but {path} does not exist; "
                                        f"pass the checkpoint folder as GradcompCallback(..., resume_from=folder)")
            self.hook.load_state_dict(torch.load(path, weights_only=True))

    def on_optimizer_step(self, args, state, control, **kwargs):
        if not self._checked:
            check_ran(self.hook, _WHERE)
            self._checked = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        # The Trainer appended these logs to state.log_history before the callbacks see them.
        if self.hook is not None and logs is not None and "loss" in logs:
            values = log_values(self.hook)
            logs.update(values)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(values)

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.hook.state_dict(), os.path.join(folder, f"gradcomp_state_{dist.get_rank()}.pt"))

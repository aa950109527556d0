"""PyTorch Lightning: ``Trainer(strategy="ddp", callbacks=[GradcompCallback(gradcomp.Q4())])`` (docs/integrations.md)."""
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy

from . import attach, check_ran, gather_state, log_values, rank_state

__all__ = ["GradcompCallback"]

_WHERE = "gradcomp.integrations.lightning.GradcompCallback"


class GradcompCallback(pl.Callback):
    """Compresses DDP's gradients with ``codec`` on CPU and CUDA alike (Lightning's own
    ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only), keeps every rank's hook
    state in Lightning's checkpoints, and logs ``gradcomp/bytes_per_step`` and ``gradcomp/ratio``.
    ``register_kwargs`` go to ``gradcomp.torch.register``."""

    def __init__(self, codec=None, **register_kwargs):
        self.codec, self.register_kwargs = codec, register_kwargs
        self.hook = None
        self._restored = None  # Lightning restores callbacks before it wraps the model
        self._checked = False

    def on_fit_start(self, trainer, pl_module):
        strategy = trainer.strategy
        # DeepSpeed's strategy derives from DDPStrategy but wraps no DDP model: attach() refuses it.
        if not isinstance(strategy, DDPStrategy):
            raise TypeError(f"{_WHERE} compresses DDP's gradients, but the trainer's strategy is "
                            f"{type(strategy).__name__}: use strategy='ddp' (for FSDP2, call gradcomp.torch.fsdp "
                            f"on the sharded modules in configure_model)")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise RuntimeError(f"{_WHERE}: DDPStrategy was also given ddp_comm_hook="
                               f"{getattr(strategy._ddp_comm_hook, '__qualname__', strategy._ddp_comm_hook)}; DDP "
                               f"takes one hook: drop ddp_comm_hook/ddp_comm_state or drop the callback")
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        self.hook = attach(strategy.model, self.codec, optimizer=optimizer, where=_WHERE,
                           wrap_hint="Use Trainer(strategy='ddp') (or DDPStrategy()).", **self.register_kwargs)
        if self._restored is not None:
            self.hook.load_state_dict(rank_state(self._restored, _WHERE))
            self._restored = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.hook is None or trainer.global_step == 0:  # no optimizer step yet (gradient accumulation)
            return
        if not self._checked:
            check_ran(self.hook, _WHERE)
            self._checked = True
        pl_module.log_dict(log_values(self.hook), on_step=True, on_epoch=False)

    def state_dict(self):
        # Lightning builds the checkpoint on every rank and rank 0 writes it: every rank's state goes in.
        return {} if self.hook is None else gather_state(self.hook)

    def load_state_dict(self, state_dict):
        self._restored = state_dict or None

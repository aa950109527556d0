"""Per-rank bodies of test_integrations.py: HookState before the process group, and gradcomp inside PyTorch Lightning."""
from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp
import gradcomp.torch as gt
from workers_common import MLP

EPOCHS = 4  # digits: 1437 training images, 32 per rank and step: 23 steps per epoch


def digits():
    """scikit-learn's digits, standardized, a fixed 80/20 split: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(d.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def _samples(text):
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def hookstate_before_init(rank, world):
    """HookState built before init_process_group, then DDP + register_comm_hook: bit-equal to register().
    Scrapes before its first bucket answer zeros and do not bind: one before the process group, and one on
    rank 0 only from another thread once the group exists (a group made there would hang the job)."""
    import threading

    state = gt.HookState(gradcomp.Q4(seed=5))
    assert not dist.is_initialized()
    early = _samples(state.metrics_text())
    assert early and not any(early.values()), early
    assert state._group is None, "a scrape bound the state"
    dist.init_process_group("gloo")
    if rank == 0:
        scraped = []
        scraper = threading.Thread(target=lambda: scraped.append(state.metrics_text()))
        scraper.start()
        scraper.join(timeout=30)
        assert scraped and _samples(scraped[0]) == early, scraped
    assert state._group is None, "a scrape bound the state"
    results = []
    for route in ("standard", "register"):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(MLP())
        hook = state if route == "standard" else gt.register(ddp, gradcomp.Q4(seed=5))
        if route == "standard":
            ddp.register_comm_hook(state, gt.comm_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + rank)
            ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert hook.stats()["total"]["steps"] == 4, hook.stats()
        if route == "standard":  # the zeros were the bound hook's metrics, same names and labels
            trained = _samples(state.metrics_text())
            shape = lambda samples: {(name, tuple(k for k, _ in labels)) for name, labels in samples}  # noqa: E731
            assert shape(trained) == shape(early), (trained, early)
            assert [v for (name, _), v in trained.items() if name == "gradcomp_steps_total"] == [4], trained
        results.append([p.detach().clone() for p in ddp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results)), "HookState made before the group differs from register()"
    return True


def hookstate_binds_once_under_concurrent_callers(rank, world):
    """Two threads of each rank call state_dict() on a state built before the process group, at once; the
    group creation is slowed so that both would pass an unguarded "is it bound yet" check. Returns how many
    times the node groups were made (each time is a collective: twice would break every later group)."""
    import threading
    import time

    from gradcomp import ddp

    state = gt.HookState(gradcomp.Q4())
    dist.init_process_group("gloo")
    made = []
    real = ddp.node_groups

    def slow(*args, **kwargs):
        made.append(1)
        time.sleep(0.3)
        return real(*args, **kwargs)

    ddp.node_groups = slow
    try:
        states = []
        threads = [threading.Thread(target=lambda: states.append(state.state_dict())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        ddp.node_groups = real
    assert len(states) == 2, states
    return len(made)


def hookstate_never_handed_to_ddp(rank, world):
    """A HookState the program never gives DDP: an error at the end of the first optimizer step."""
    dist.init_process_group("gloo")
    state = gt.HookState(gradcomp.Q4())  # noqa: F841 (kept alive: the program "asked" for it)
    ddp = nn.parallel.DistributedDataParallel(MLP())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ddp(torch.randn(4, 64)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


# ---- PyTorch Lightning ----

def _lightning_module():
    import pytorch_lightning as pl

    class Digits(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = MLP((64, 64, 10))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def train_dataloader(self):
            x, y, _, _ = digits()
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Digits()


def _trainer(tmp, callbacks=(), strategy=None, epochs=EPOCHS, checkpoints=False):
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    cbs = list(callbacks)
    if checkpoints:  # one per epoch, kept: resume from the end of epoch 2 (deterministic data order)
        cbs.append(pl.callbacks.ModelCheckpoint(dirpath=tmp, save_top_k=-1, every_n_epochs=1, filename="{epoch}"))
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy or DDPStrategy(), max_epochs=epochs,
                      callbacks=cbs, logger=False, enable_checkpointing=checkpoints, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp, num_sanity_val_steps=0)


def _expect_error(kind, fn, *words):
    try:
        fn()
    except kind as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f"error lacks {missing}: {e}"
        return str(e)
    raise AssertionError(f"expected {kind.__name__} naming {words}")


def lightning(rank, world, tmp):
    """Dense and q4 runs on digits, resume from Lightning's checkpoint, and the misuse cases."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

    from gradcomp.integrations.lightning import GradcompCallback

    _, _, x_test, y_test = digits()
    out = {}
    dense = _lightning_module()
    _trainer(tmp).fit(dense)
    out["dense_accuracy"] = accuracy(dense, x_test, y_test)

    callback = GradcompCallback(gradcomp.Q4(seed=5))
    model = _lightning_module()
    trainer = _trainer(tmp, [callback], checkpoints=True)
    trainer.fit(model)
    total = callback.hook.stats()["total"]
    out.update(q4_accuracy=accuracy(model, x_test, y_test), hook_steps=total["steps"],
               optimizer_steps=trainer.global_step, ratio=total["ratio"],
               logged_ratio=float(trainer.callback_metrics["gradcomp/ratio"]),
               logged_bytes=float(trainer.callback_metrics["gradcomp/bytes_per_step"]))
    final, final_state = [p.detach().clone() for p in model.parameters()], callback.hook.state_dict()

    # Resume from the end of epoch 2 through Lightning's own checkpoint: bit-exact to the run above.
    ckpt = os.path.join(tmp, "epoch=1.ckpt")
    assert os.path.exists(ckpt), sorted(glob.glob(os.path.join(tmp, "*")))
    resumed_cb, resumed = GradcompCallback(gradcomp.Q4(seed=5)), _lightning_module()
    _trainer(tmp, [resumed_cb]).fit(resumed, ckpt_path=ckpt)
    out["resume_bit_exact"] = all(torch.equal(a, b) for a, b in zip(final, resumed.parameters()))
    out["resume_state_step"] = (resumed_cb.hook.state_dict()["step"], final_state["step"])

    # Misuse: each a clear error that says what to do. Two callbacks: Lightning itself refuses them by name.
    out["twice"] = _expect_error(RuntimeError, lambda: _trainer(
        tmp, [GradcompCallback(), GradcompCallback()], epochs=1).fit(_lightning_module()), "more than one")
    out["with_strategy_hook"] = _expect_error(RuntimeError, lambda: _trainer(
        tmp, [GradcompCallback()], epochs=1,
        strategy=DDPStrategy(ddp_comm_state=gt.HookState(gradcomp.Q4()), ddp_comm_hook=gt.comm_hook)
    ).fit(_lightning_module()), "ddp_comm_hook")
    single = pl.Trainer(accelerator="cpu", strategy=SingleDeviceStrategy("cpu"), logger=False)
    out["wrong_strategy"] = _expect_error(TypeError, lambda: GradcompCallback().on_fit_start(
        single, _lightning_module()), "SingleDeviceStrategy", "strategy='ddp'")
    return out


def lightning_documented_route_on_cpu(rank, world, tmp):
    """Lightning's documented comm-hook route on the CPU, in a fresh process (gradcomp accepts the first step of a
    process where any of its hooks is at work): the state is made before the process group (issue 38's first
    failure) and Lightning then drops the hook off CUDA; gradcomp says so at the end of the first step."""
    from pytorch_lightning.strategies import DDPStrategy

    strategy = DDPStrategy(ddp_comm_state=gt.HookState(gradcomp.Q4()), ddp_comm_hook=gt.comm_hook)
    return _expect_error(RuntimeError, lambda: _trainer(tmp, strategy=strategy, epochs=1).fit(_lightning_module()),
                         "GradcompCallback", "CUDA only")


def run_doc_block(rank, world, code, tmp):
    """Runs a docs/integrations.md recipe as its own script would run under torchrun (a scratch folder as `tmp`)."""
    exec(compile(code, "docs/integrations.md", "exec"), {"tmp": tmp, "__name__": "__main__"})
    return True

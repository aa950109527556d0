"""Per-rank bodies of test_integrations.py for Hugging Face Accelerate and the Trainer (tiny models built in code)."""
from __future__ import annotations

import os

import torch
import torch.nn as nn

import gradcomp
from workers_common import MLP
from workers_integrations import _expect_error, accuracy, digits

STEPS, BATCH = 60, 32


def _batches(x, y, rank, world, steps):
    for step in range(steps):  # a fixed order: step s takes its own slice on each rank
        i = torch.randperm(len(y), generator=torch.Generator().manual_seed(step))[:BATCH * world]
        i = i[rank::world]
        yield x[i], y[i]


def _accelerate_run(tmp, codec, steps, save_at=None, load=None, via_module=False):
    from accelerate import Accelerator

    from gradcomp.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = MLP((64, 64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    hook = register(accelerator, model, codec, optimizer=opt) if codec is not None else None
    start = 0
    if load is not None:
        accelerator.load_state(load)
        start = save_at
    x, y, _, _ = digits()
    for step, (xb, yb) in enumerate(_batches(x, y, accelerator.process_index, accelerator.num_processes, steps)):
        if step < start:
            continue
        net = model.module if via_module else model  # via_module: the misuse of running the inner module
        loss = nn.functional.cross_entropy(net(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if save_at is not None and load is None and step + 1 == save_at:
            accelerator.save_state(os.path.join(tmp, "accelerate-ckpt"))
    accelerator.free_memory()
    return model.module, hook


def accelerate(rank, world, tmp):
    from accelerate import Accelerator

    from gradcomp.integrations.accelerate import register

    _, _, x_test, y_test = digits()
    out = {}
    dense, _ = _accelerate_run(tmp, None, STEPS)
    out["dense_accuracy"] = accuracy(dense, x_test, y_test)
    model, hook = _accelerate_run(tmp, gradcomp.Q4(seed=5), STEPS, save_at=STEPS // 2)
    total = hook.stats()["total"]
    out.update(q4_accuracy=accuracy(model, x_test, y_test), hook_steps=total["steps"], optimizer_steps=STEPS,
               ratio=total["ratio"])
    resumed, _ = _accelerate_run(tmp, gradcomp.Q4(seed=5), STEPS, save_at=STEPS // 2,
                                 load=os.path.join(tmp, "accelerate-ckpt"))
    out["resume_bit_exact"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

    accelerator = Accelerator(cpu=True)
    raw = MLP()
    out["before_prepare"] = _expect_error(TypeError, lambda: register(accelerator, raw), "accelerator.prepare")
    prepared = accelerator.prepare(MLP())
    register(accelerator, prepared)
    out["twice"] = _expect_error(RuntimeError, lambda: register(accelerator, prepared), "already registered")
    out["never_called"] = _expect_error(RuntimeError, lambda: _accelerate_run(
        tmp, gradcomp.Q4(), 1, via_module=True), "hook never ran")
    return out


class DigitsModel(nn.Module):
    """What the Trainer expects of a model: keyword inputs, a loss in the output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP((64, 64, 10))

    def forward(self, pixels, labels=None):
        logits = self.net(pixels)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class _Digits(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y, _, _ = digits()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixels": self.x[i], "labels": self.y[i]}


def _trainer(tmp, epochs=2, save_steps=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=os.path.join(tmp, "hf"), per_device_train_batch_size=BATCH,
                             num_train_epochs=epochs, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=5,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                             remove_unused_columns=False, dataloader_num_workers=0, ddp_backend="gloo")
    return Trainer(model=DigitsModel(), args=args, train_dataset=_Digits())


def transformers(rank, world, tmp):
    from gradcomp.integrations.transformers import GradcompCallback

    _, _, x_test, y_test = digits()
    out = {}
    dense = _trainer(tmp)
    dense.train()
    out["dense_accuracy"] = accuracy(dense.model.net, x_test, y_test)

    trainer = _trainer(tmp, save_steps=23)
    callback = GradcompCallback(trainer, gradcomp.Q4(seed=5))
    trainer.add_callback(callback)
    trainer.train()
    total = callback.hook.stats()["total"]
    out.update(q4_accuracy=accuracy(trainer.model.net, x_test, y_test), hook_steps=total["steps"],
               optimizer_steps=trainer.state.global_step, ratio=total["ratio"],
               logged=[h for h in trainer.state.log_history if "gradcomp/ratio" in h])

    resumed = _trainer(tmp, save_steps=23)
    resumed.add_callback(GradcompCallback(resumed, gradcomp.Q4(seed=5)))
    resumed.train(resume_from_checkpoint=os.path.join(tmp, "hf", "checkpoint-23"))
    out["resume_bit_exact"] = all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(),
                                                                      resumed.model.parameters()))
    twice = _trainer(tmp)
    twice.add_callback(GradcompCallback(twice))
    twice.add_callback(GradcompCallback(twice))
    out["twice"] = _expect_error(RuntimeError, twice.train, "already registered")
    return out

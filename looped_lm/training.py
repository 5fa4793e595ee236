"""One optimiser step, the same for the trainer (under DeepSpeed) and for the benchmarks (plain PyTorch).

    train_step(model, optimizer, runner, batches, step, seed) -> StepResult

A step chooses the parameter units it updates (`model.step_units`: a DiffusionBlocks step trains one
block; `BlockwiseAdamW` leaves the others untouched), then runs each micro-batch's training loss forward
and backward, then the optimiser. How the loss is scaled, accumulated, clipped and applied is the
runner's job: DeepSpeed's engine in the trainer (`train.DeepSpeedRunner`: accumulation, clipping,
ZeRO), `TorchRunner` below elsewhere.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from looped_lm.models.contract import Trainable


@dataclass
class StepResult:
    """What a step leaves, on the device: reading a value (float(), .item()) waits for the step to finish,
    so the trainer reads them at log steps only."""

    loss: torch.Tensor  # 0-d, mean over the step's micro-batches (this process's)
    metrics: dict  # the model's metrics of the last micro-batch (DB models: block (an int), loss_block{b}, ...)


class Runner(Protocol):
    def loss(self, x: torch.Tensor, y: torch.Tensor, step: int) -> tuple[torch.Tensor, dict]:
        """The training loss of one micro-batch and the model's metrics."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def micro_step(self) -> None:
        """After each micro-batch: the optimiser steps at the end of the accumulation."""


def train_step(model: Trainable, optimizer, runner: Runner, batches: Iterable, step: int, seed: int) -> StepResult:
    """One optimiser step of `model` over the micro-batches `batches` ((x, y) pairs, on the device)."""
    optimizer.set_active_units(model.step_units(step, seed))
    total, count, metrics = None, 0, {}
    for x, y in batches:
        loss, metrics = runner.loss(x, y, step)
        runner.backward(loss)
        runner.micro_step()
        total = loss.detach() if total is None else total + loss.detach()  # no host sync
        count += 1
    return StepResult(total / max(count, 1), metrics)


class TrainingModule(torch.nn.Module):
    """What DeepSpeed wraps: forward returns the loss of one micro-batch, metrics kept aside."""

    def __init__(self, model: Trainable, seed: int):
        super().__init__()
        self.model, self.seed, self.last_metrics = model, seed, {}

    def forward(self, x, y, step: int):
        loss, self.last_metrics = self.model.training_loss(x, y, step=step, seed=self.seed)
        return loss


class TorchRunner:
    """Plain PyTorch: each micro-batch's loss / grad_accum backward; after the last one, global-norm
    clipping (0 = off) and the optimiser step. `loss_fn(x, y, step, seed)` replaces the model's training
    loss (e.g. a benchmark's fixed recurrence); `amp_dtype` runs the forward under autocast."""

    def __init__(self, model: Trainable, optimizer, grad_accum: int = 1, grad_clip: float = 1.0, seed: int = 0,
                 loss_fn=None, amp_dtype: torch.dtype | None = None):
        self.model, self.optimizer, self.grad_accum, self.grad_clip, self.seed = \
            model, optimizer, grad_accum, grad_clip, seed
        self.loss_fn = loss_fn or model.training_loss
        self.amp_dtype, self.micro = amp_dtype, 0

    def loss(self, x, y, step):
        amp = torch.autocast(x.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()
        with amp:
            return self.loss_fn(x, y, step=step, seed=self.seed)

    def backward(self, loss) -> None:
        (loss / self.grad_accum).backward()

    def micro_step(self) -> None:
        self.micro += 1
        if self.micro % self.grad_accum == 0:
            self.optimizer_step()

    def optimizer_step(self) -> None:
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

"""The optimiser and LR schedule the trainer hands to DeepSpeed.

`BlockwiseAdamW` is torch's AdamW (no compiled extension, so it runs on CPU) with one addition:
parameter groups carry a `unit` name ("shared", "block0", ...) and only the units marked active for
this step are updated. DiffusionBlocks trains one block per step; without this, AdamW would still
move the idle blocks by their momentum and weight decay (DeepSpeed reduces zero gradients for
parameters a step did not use). This works at every ZeRO stage because ZeRO 1/2 keep the client's
group dicts (one flat partition per group).
"""

from __future__ import annotations

import math

import torch


class BlockwiseAdamW(torch.optim.AdamW):
    def __init__(self, param_groups, **kw):
        super().__init__(param_groups, **kw)
        self.active_units: set[str] | None = None  # None = every unit

    def set_active_units(self, units) -> None:
        self.active_units = None if units is None else set(units)

    @torch.no_grad()
    def step(self, closure=None):
        if self.active_units is not None:
            for group in self.param_groups:
                if group.get("unit", "shared") not in self.active_units:
                    for p in group["params"]:
                        p.grad = None  # AdamW skips parameters without a gradient
        return super().step(closure)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Groups per unit (model.param_unit(name), default "shared"), split into decay / no-decay.

    Matrices decay; norms, biases and gains (1-D) do not (nanoGPT's rule). Frozen parameters are left
    out, so they hold no optimiser state.
    """
    unit_of = model.param_unit
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2
        groups.setdefault((unit_of(name), decay), []).append(p)
    return [{"params": ps, "unit": unit, "weight_decay": weight_decay if decay else 0.0}
            for (unit, decay), ps in sorted(groups.items())]


def cosine_with_warmup(step: int, warmup: int, max_steps: int, lr: float, min_lr: float) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at max_steps (nanoGPT's get_lr)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= max_steps:
        return min_lr
    progress = (step - warmup) / max(1, max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)

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

from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state
import torch

from looped_lm.devices import adamw_implementation  # noqa: F401  (re-exported: callers pick a path by device)


ADAMW_IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


class BlockwiseAdamW(torch.optim.AdamW):
    """AdamW that steps only the active units. `implementation` chooses torch's kernel path; all three skip
    a parameter whose gradient is None, which is how an idle unit keeps its weights and moments."""

    def __init__(self, param_groups, implementation: str = "for-loop", **kw):
        if implementation not in ADAMW_IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {ADAMW_IMPLEMENTATIONS} (got {implementation!r})")
        kw.update(foreach=implementation == "foreach", fused=implementation == "fused")
        super().__init__(param_groups, **kw)
        self.implementation = implementation
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
    out, so they hold no optimiser state. "names" lists the parameters' names: ZeRO replaces "params" by
    one flat partition and keeps the rest of the group.
    """
    unit_of = model.param_unit
    groups: dict[tuple[str, bool], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2
        groups.setdefault((unit_of(name), decay), []).append((name, p))
    return [{"params": [p for _, p in named], "names": [n for n, _ in named], "unit": unit,
             "weight_decay": weight_decay if decay else 0.0}
            for (unit, decay), named in sorted(groups.items())]


def cosine_with_warmup(step: int, warmup: int, max_steps: int, lr: float, min_lr: float) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at max_steps (nanoGPT's get_lr)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= max_steps:
        return min_lr
    progress = (step - warmup) / max(1, max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# ---------------------------------------------------------------------------------------------
# optimiser state by parameter name: what a checkpoint keeps, whatever the ZeRO stage, world size or mode
#
# A checkpoint holds, per unit, the AdamW moments of every parameter under its name and the unit's step
# count (BlockwiseAdamW steps units apart). Those are the same numbers at ZeRO 0 (one state per
# parameter) and ZeRO 1/2 (one flat fp32 partition per parameter group and rank, which DeepSpeed's public
# safe_get/safe_set_full_* functions gather and scatter per parameter), so a checkpoint written at one
# stage, world size or train.mode resumes exactly at another.

MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_of(state: dict) -> int:
    return int(state["step"]) if "step" in state else 0


def _zero_groups(model, optimizer):
    """(unit, flat fp32 partition, its parameters) of each ZeRO 1/2 group. ZeRO gives our optimiser one
    flat partition per group (group["params"] == [flat]) and keeps the group's other keys: "names" (set by
    `param_groups`) says which parameters the partition holds."""
    params = dict(model.named_parameters())
    return [(g["unit"], g["params"][0], [params[n] for n in g["names"]]) for g in optimizer.param_groups]


def _linked_state(optimizer, flat, params) -> dict:
    """The AdamW state of one flat partition, its parameters' fragments linked to it. DeepSpeed links the
    fragments once, after the first step, and BlockwiseAdamW creates a unit's state at that unit's first
    step, which may come later; so a unit that has not stepped gets the state AdamW would start it with
    (step 0, zero moments: the same update), every rank then holds the same tensors and takes part in
    every gather."""
    state = optimizer.state[flat]
    if not state:
        state.update(step=torch.tensor(0.0), **{k: torch.zeros_like(flat) for k in MOMENTS})
    lazy_init_hp_params_optimizer_state(params, flat, optimizer.state)
    return state


@torch.no_grad()
def state_by_name(model, optimizer, zero_optimizer=None, dist=None, master: bool = False) -> dict:
    """{unit: (step, {"exp_avg/<name>": tensor, "exp_avg_sq/<name>": ..., ["fp32/<name>": master]})} of every
    unit this rank trains, whole. ZeRO 1/2 (`zero_optimizer` set; `optimizer` is ours, inside it): gathered
    from the partitions with one all-reduce per tensor over the data-parallel ranks, so every rank must call
    it. `master`: also the fp32 weights (ZeRO's fp32 partitions, or the parameters themselves)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict = {}
    if zero_optimizer is None:
        for group in optimizer.param_groups:
            entry = out.setdefault(group["unit"], [0, {}])
            tensors = entry[1]
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                entry[0] = max(entry[0], _step_of(st))
                for key in MOMENTS:
                    tensors[f"{key}/{names[id(p)]}"] = st[key].clone() if key in st else torch.zeros_like(p)
                if master:
                    tensors[f"fp32/{names[id(p)]}"] = p.detach().float().clone()
        return {unit: (step, tensors) for unit, (step, tensors) in out.items()}

    for unit, flat, params in _zero_groups(model, optimizer):
        st = _linked_state(optimizer, flat, params)
        entry = out.setdefault(unit, [0, {}])
        entry[0] = max(entry[0], _step_of(st))
        for p in params:
            for key in MOMENTS:
                entry[1][f"{key}/{names[id(p)]}"] = safe_get_full_optimizer_state(p, key)
            if master:
                entry[1][f"fp32/{names[id(p)]}"] = safe_get_full_fp32_param(p)
    return {unit: (step, tensors) for unit, (step, tensors) in out.items()}


@torch.no_grad()
def load_state_by_name(model, optimizer, states: dict, zero_optimizer=None) -> None:
    """Put `states` ({unit: (step, tensors)}, as `state_by_name` returns) into this rank's optimiser: whole
    per parameter at ZeRO 0, this rank's fragments of the flat partitions at ZeRO 1/2. A unit at step 0
    starts fresh; saved fp32 master weights replace the (possibly bf16-rounded) weights the model was
    loaded with."""
    names = {id(p): n for n, p in model.named_parameters()}
    if zero_optimizer is None:
        for group in optimizer.param_groups:
            step, tensors = states[group["unit"]]
            for p in group["params"]:
                if step:
                    optimizer.state[p] = {"step": torch.tensor(float(step)),
                                          **{k: tensors[f"{k}/{names[id(p)]}"].to(p) for k in MOMENTS}}
                master = tensors.get(f"fp32/{names[id(p)]}")
                if master is not None:  # fp32 weights the bf16 ones of model.safetensors were rounded from
                    p.copy_(master.to(p))
        return

    for unit, flat, params in _zero_groups(model, optimizer):
        step, tensors = states[unit]
        st = _linked_state(optimizer, flat, params)
        for p in params:
            if step:
                for key in MOMENTS:
                    safe_set_full_optimizer_state(p, tensors[f"{key}/{names[id(p)]}"].to(flat), key)
            master = tensors.get(f"fp32/{names[id(p)]}")
            if master is not None:
                safe_set_full_fp32_param(p, master.to(flat))
        if step:
            st["step"] = torch.tensor(float(step))

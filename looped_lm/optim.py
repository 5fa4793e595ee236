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


# ---------------------------------------------------------------------------------------------
# optimiser state by parameter name: what a checkpoint keeps, whatever the ZeRO stage, world size or mode
#
# A checkpoint holds, per unit, the AdamW moments of every parameter under its name and the unit's step
# count (BlockwiseAdamW steps units apart). Those are the same numbers at ZeRO 0 (one state per
# parameter) and ZeRO 1/2 (one flat fp32 partition per parameter group and rank, which DeepSpeed maps back
# to parameters through each parameter's `_hp_mapping` fragment addresses), so a checkpoint written at one
# stage, world size or train.mode resumes exactly at another.

MOMENTS = ("exp_avg", "exp_avg_sq")


def _zero_groups(zero_optimizer):
    """(unit, flat fp32 partition, its parameters, its process group) of each ZeRO 1/2 parameter group."""
    inner = zero_optimizer.optimizer
    return [(group["unit"], zero_optimizer.single_partition_of_fp32_groups[i], zero_optimizer.bit16_groups[i],
             zero_optimizer.real_dp_process_group[i]) for i, group in enumerate(inner.param_groups)]


def _step_of(state: dict) -> int:
    return int(state["step"]) if "step" in state else 0


@torch.no_grad()
def state_by_name(model, optimizer, zero_optimizer=None, dist=None, master: bool = False) -> dict:
    """{unit: (step, {"exp_avg/<name>": tensor, "exp_avg_sq/<name>": ..., ["fp32/<name>": master]})} of every
    unit this rank trains, whole. ZeRO 1/2 (`zero_optimizer`, DeepSpeed's): gathered from the partitions
    with one all-reduce per tensor over its group's ranks, so every rank of the group must call it.
    `master`: also the fp32 weights (ZeRO's fp32 partitions, or the parameters themselves)."""
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
    inner = zero_optimizer.optimizer
    for unit, flat, params, group in _zero_groups(zero_optimizer):
        st = dict(inner.state.get(flat, {}))
        keys = MOMENTS + (("fp32",) if master else ())
        if master:
            st["fp32"] = flat
        entry = out.setdefault(unit, [0, {}])
        tensors = entry[1]
        entry[0] = max(entry[0], _step_of(st))
        for p in params:
            for key in keys:
                full = torch.zeros(p.numel(), dtype=torch.float32, device=flat.device)
                if key in st and p._hp_mapping is not None:  # this rank's fragment of p
                    lp, hp = p._hp_mapping.lp_fragment_address, p._hp_mapping.hp_fragment_address
                    full[lp.start:lp.start + lp.numel] = st[key][hp.start:hp.start + hp.numel]
                dist.all_reduce(full, group=group)
                tensors[f"{key}/{names[id(p)]}"] = full.view_as(p)
    return {unit: (step, tensors) for unit, (step, tensors) in out.items()}


@torch.no_grad()
def load_state_by_name(model, optimizer, states: dict, zero_optimizer=None) -> None:
    """Put `states` ({unit: (step, tensors)}, as `state_by_name` returns) into this rank's optimiser: whole
    per parameter at ZeRO 0, this rank's fragments of the flat partitions at ZeRO 1/2 (DeepSpeed links
    them to its parameters at the first step). A unit at step 0 starts fresh; saved fp32 master weights
    replace the (possibly bf16-rounded) weights the model was loaded with."""
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
    inner = zero_optimizer.optimizer
    for unit, flat, params, _ in _zero_groups(zero_optimizer):
        step, tensors = states[unit]
        moments = {k: torch.zeros_like(flat) for k in MOMENTS}
        for p in params:
            if p._hp_mapping is None:
                continue
            lp, hp = p._hp_mapping.lp_fragment_address, p._hp_mapping.hp_fragment_address
            for key, buf in [*moments.items(), ("fp32", flat)]:
                saved = tensors.get(f"{key}/{names[id(p)]}")
                if saved is not None:
                    buf[hp.start:hp.start + hp.numel] = saved.reshape(-1)[lp.start:lp.start + lp.numel].to(buf)
        if step:
            inner.state[flat] = {"step": torch.tensor(float(step)), **moments}

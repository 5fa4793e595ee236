"""The benches' one equal-FLOPs training loop: runs that are compared get the same counted training FLOPs.

    steps = plan_steps(cost_at, budget, curve_every, curve_cost)     # how many steps fit the budget
    state = train(model, opt, runner, steps, seed, batch_at, cost_at, lr_at, ...)

Each step is the trainer's own optimiser step (`looped_lm.training.train_step`), charged `cost_at(step)`
FLOPs: the cost of the block (DiffusionBlocks) or recurrence (huginn) that step trains, so uneven layer
splits and random recurrences are charged what they cost. A model that re-measures its CE(sigma) curve
(`uses_curve()`) does so every `curve_every` steps, as the trainer does, on a training batch; each
measurement is charged its counted forward FLOPs. The loop keeps its progress in `state`, so a caller
can checkpoint it (`after_step`) and resume. Used by bench/quality.py and bench/vocab_options.py.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from looped_lm.training import train_step


def counted(fn) -> int:
    """Matmul FLOPs torch's FlopCounterMode counts in fn() (math attention kernel: every pair it computes)."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return counter.get_total_flops()


def plan_steps(cost_at: Callable[[int], float], budget: float, curve_every: int = 0, curve_cost: float = 0.0) -> int:
    """The steps whose FLOPs (each step's own, plus a curve measurement every curve_every steps) fit
    within `budget`: the last step may end past it by less than one step."""
    total, step = 0.0, 0
    while total < budget:
        total += cost_at(step)
        if curve_cost and curve_every and step % curve_every == 0:
            total += curve_cost
        step += 1
    return step


def fresh_state() -> dict:
    return {"step": 0, "flops": 0.0, "curve_flops": 0.0, "cpu_s": 0.0, "wall_s": 0.0, "block_updates": {},
            "curves": []}


def train(model, opt, runner, steps: int, seed: int, batch_at: Callable[[int], tuple], cost_at: Callable[[int], float],
          lr_at: Callable[[int], float], curve_every: int = 0, curve_batch_at: Callable[[int], tuple] | None = None,
          state: dict | None = None, after_step: Callable[[dict, object], None] | None = None, name: str = "") -> dict:
    """Train `model` from state["step"] to `steps`; -> the state: steps done, FLOPs spent (curves included),
    CPU and wall seconds of the optimiser steps, updates per DiffusionBlocks block, the measured curves."""
    state = state if state is not None else fresh_state()
    uses_curve = bool(curve_every) and hasattr(model, "uses_curve") and model.uses_curve()
    model.train()
    while state["step"] < steps:
        step = state["step"]
        if uses_curve and step % curve_every == 0:  # as the trainer refreshes it, on a training batch
            xc, yc = curve_batch_at(step)
            model.eval()
            box = {}
            flops = counted(lambda: box.update(c=model.measure_curve(xc, yc, seed=step)))
            model.apply_curve(box["c"])
            model.train()
            state["curve_flops"] += flops
            state["flops"] += flops
            state["curves"].append({"step": step, "ce": box["c"]["ce"]})
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch_at(step)
        t0, c0 = time.perf_counter(), time.process_time()
        result = train_step(model, opt, runner, [(x, y)], step, seed)
        state["cpu_s"] += time.process_time() - c0
        state["wall_s"] += time.perf_counter() - t0
        state["flops"] += cost_at(step)
        if "block" in result.metrics:
            b = str(result.metrics["block"])
            state["block_updates"][b] = state["block_updates"].get(b, 0) + 1
        state["step"] += 1
        if not math.isfinite(result.loss):
            raise RuntimeError(f"{name} seed {seed}: loss {result.loss} at step {step}")
        if after_step is not None:
            after_step(state, result)
    return state

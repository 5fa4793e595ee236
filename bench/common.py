"""What the bench scripts share (bench/ is not a package: a script puts bench/ on sys.path and imports this).

An equal-FLOPs training loop (bench/scaleout.py; the retired quality study's, bench/quality.py at commit
a2d4a89, was the same): runs that are compared get the same counted training FLOPs.

    steps = plan_steps(cost_at, budget, curve_every, curve_cost)     # how many steps fit the budget
    state = train(model, opt, runner, steps, seed, batch_at, cost_at, lr_at, ...)

Each step is the trainer's own optimiser step (`looped_lm.training.train_step`), charged `cost_at(step)`
FLOPs: the cost of the block (DiffusionBlocks) or recurrence (huginn) that step trains, so uneven layer
splits and random recurrences are charged what they cost. A model that re-measures its CE(sigma) curve
(`uses_curve()`) does so every `curve_every` steps, as the trainer does, on a training batch; each
measurement is charged its counted forward FLOPs. The loop keeps its progress in `state`, so a caller
can checkpoint it (`after_step`) and resume. Also: counted FLOPs and saved-for-backward bytes of one
training step, the git commit, an atomic JSON write, subprocess lanes and 95 % intervals.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def counted(fn) -> int:
    """Matmul FLOPs torch's FlopCounterMode counts in fn() (math attention kernel: every pair it computes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return counter.get_total_flops()


def step_flops(model, x, y, step: int, seed: int = 0) -> int:
    """FlopCounterMode's FLOPs of one training step (forward + backward) of `model` at `step`."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model.training_loss(x, y, step, seed)[0].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def saved_bytes(model, x, y, step: int) -> int:
    """Bytes autograd saves for backward in one training step (each storage once; parameters and buffers
    excluded)."""
    import torch

    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    own |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model.training_loss(x, y, step, seed=0)
    del loss
    return sum(seen.values())


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
    from looped_lm.training import train_step

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


def train_bible_db(cfg, tokenizer: str, seed: int, steps: int | None, budget: float | None, warmup: int, name: str,
                  time_blocks: bool = False):
    """A db_ar of `cfg` (lr cfg.train.lr with `warmup` steps and a cosine to cfg.train.min_lr, wd 0.1, clip 1)
    on the embedded Bible through `train`: `steps` steps, or as many as fit `budget` counted FLOPs (each step
    its block's FlopCounterMode count on a training batch, each curve refresh its forward count). -> (model,
    state (+ train_cpu_s), FLOPs per block step, CPU seconds per block step (median of 3, `time_blocks`), val)."""
    import torch

    from looped_lm.data.bin_dataset import TokenStream
    from looped_lm.data.prepare import ensure_prepared
    from looped_lm.models import build_model
    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
    from looped_lm.training import TorchRunner

    data = Path(ensure_prepared("bible", str(ROOT / "data_cache"), tokenizer, 0.05, seed, progress=False))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    seq, batch, lr, min_lr = cfg.model.seq_len, cfg.train.batch_size, cfg.train.lr, cfg.train.min_lr
    train_data, val = TokenStream(str(data / "train.bin"), seq), TokenStream(str(data / "val.bin"), seq)
    x0, y0 = train_data.get_batch(batch, seed, 0, 0, 0)
    flops_of, seconds_of = {}, {}
    for b in range(cfg.diffusion.num_blocks):  # a copy of the model that trains block b only
        one = cfg.model_copy(deep=True)
        one.diffusion.blocks_to_train = [b]
        block = build_model(one, vocab)
        flops_of[b] = step_flops(block, x0, y0, 0)
        if time_blocks:
            times = []
            for _ in range(3):
                t0 = time.process_time()
                block.training_loss(x0, y0, 0, 0)[0].backward()
                times.append(time.process_time() - t0)
            seconds_of[b] = sorted(times)[1]
    torch.manual_seed(seed)
    model = build_model(cfg, vocab)
    curve_every = cfg.diffusion.curve_every if model.uses_curve() else 0
    curve_cost = 0.0
    if curve_every:  # one measurement's forward FLOPs, charged at every refresh
        model.eval()
        curve_cost = counted(lambda: model.measure_curve(x0, y0, seed=0))
        model.train()
    torch.manual_seed(seed + 1)

    def cost_at(step: int) -> float:
        return flops_of[model.choose_block(step, seed)]

    steps = steps if budget is None else plan_steps(cost_at, budget, curve_every, curve_cost)
    opt = BlockwiseAdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=False)
    runner = TorchRunner(model, opt, grad_clip=1.0, seed=seed)
    c0 = time.process_time()
    state = train(model, opt, runner, steps, seed, batch_at=lambda step: train_data.get_batch(batch, seed, step, 0, 0),
                  cost_at=cost_at, lr_at=lambda step: cosine_with_warmup(step, warmup, steps, lr, min_lr),
                  curve_every=curve_every, curve_batch_at=lambda step: train_data.get_batch(batch, seed, -2 - step, 0, 0),
                  name=name)
    state["train_cpu_s"] = time.process_time() - c0
    return model, state, flops_of, seconds_of, val


def val_rows(val, n: int, seq: int = 128):
    """n windows of seq + 1 tokens spread evenly over a validation stream (the first at 0, the last at the end)."""
    import torch

    tokens = torch.from_numpy(val.tokens[:].astype("int64"))
    starts = torch.linspace(0, len(tokens) - seq - 2, n).long()
    return torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def write_json(obj, path: Path) -> None:
    """Write JSON atomically (a stop never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def run_lanes(jobs: list[tuple[list[str], Path | None]], lanes: int, env: dict | None = None) -> list[str]:
    """Run (argv, log file or None) jobs `lanes` at a time, one torch thread each; -> the failed jobs' argv."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    todo, running, failed = list(jobs), [], []
    while todo or running:
        while todo and len(running) < lanes:
            argv, log = todo.pop(0)
            out = open(log, "a") if log else None
            running.append((argv, subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT if out
                                                   else None, env=env)))
            print(f"started {' '.join(argv[1:])}", flush=True)
        time.sleep(2)
        for item in list(running):
            if item[1].poll() is not None:
                running.remove(item)
                print(f"finished {' '.join(item[0][1:])}: exit {item[1].returncode}", flush=True)
                if item[1].returncode:
                    failed.append(" ".join(item[0][1:]))
    return failed


def ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the Student-t 95 % interval; nan for one value)."""
    from scipy.stats import t

    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, 95 % low, 95 % high) of ratios: a Student-t interval on their logs (nan bounds for one)."""
    m, h = ci([math.log(x) for x in ratios])
    return math.exp(m), math.exp(m - h), math.exp(m + h)

"""One run, phase by phase (`_train`): check it, build the model (restored, or from a pretrained source), start
the engine, resume the optimizer state and RNG, open the logs; then the loop (steps, and the evals, curve
refreshes and saves that fall due after each)."""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import torch

from looped_lm import checkpoint as ckpt_io
from looped_lm import devices, parallel, tensor_files
from looped_lm.compile import compile_for_training
from looped_lm.config import Config, init_source
from looped_lm.data.batches import open_batches
from looped_lm.errors import RunFailure, UserError
from looped_lm.fields import TRAIN, VAL
from looped_lm.kinds import kind_of
from looped_lm.manifest import OPTIMIZER_BY_UNIT
from looped_lm.mfu import StepFlops, peak_flops
from looped_lm.models import build_model
from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, load_state_by_name, param_groups
from looped_lm.preflight import Plan, nothing_to_train, preflight
from looped_lm.pretrained import init_from_pretrained, load_base
from looped_lm.trainer.args import PREFLIGHT_DONE
from looped_lm.trainer.distributed import DeepSpeedRunner, deepspeed_config, init_distributed, on_rank0
from looped_lm.trainer.report import FlopsMeter, MetricsLogger, Report
from looped_lm.trainer.saving import run_manifest, save
from looped_lm.training import TrainingModule, train_step


def train(cfg: Config, stop_after: int = 0, verify: bool = True) -> Path | None:
    """Run training; return the final checkpoint directory (on every rank)."""
    device = init_distributed()

    torch.set_float32_matmul_precision(devices.fp32_matmul_precision(device.type, cfg.deepspeed.bf16))
    try:
        result = _train(cfg, device, stop_after, verify)
        dist.barrier()  # before teardown: avoids a rare abort of gloo ranks at exit
        return result
    finally:
        dist.destroy_process_group()


def _train(cfg: Config, device, stop_after: int, verify: bool) -> Path | None:
    """The run, phase by phase: check it, build the model (restored, or from a pretrained source), start the
    engine, resume the optimizer state and RNG, open the logs, then the loop (steps, evals, saves)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = _check_run(cfg, verify, rank, world)
    if nothing_to_train(plan, cfg):
        return Path(plan.resume)
    if cfg.train.max_steps == 0:
        return _write_conversion(cfg, plan, rank, world)
    run = _Run(cfg, device, rank, world, plan, *_open_streams(cfg, plan))
    run.model = _build_model(cfg, plan, rank, world)
    run.start_step = plan.manifest.step if plan.manifest is not None else 0
    _start_engine(run)
    _resume_state(run)
    _open_outputs(run, stop_after)
    return _loop(run)


@dataclass
class _Run:
    """What the phases of one run share: set up once, then read (and `last_ckpt`, `skipped` updated) by the loop."""

    cfg: Config
    device: Any
    rank: int
    world: int
    plan: Plan
    train_stream: Any
    val_stream: Any
    model: Any = None
    start_step: int = 0
    engine: Any = None
    optimizer: Any = None  # ours (BlockwiseAdamW), also under ZeRO, which wraps it
    schedule: Any = None
    exchange: Any = None  # block parallel: parallel.BlockParallel
    runner: DeepSpeedRunner | None = None
    tokens_seen: int = 0  # at start_step
    end_step: int = 0
    tokens_per_step: int = 0
    last_ckpt: Path | None = None
    skipped: int = 0  # non-finite steps skipped so far (train.skip_nonfinite)
    logger: MetricsLogger | None = None  # rank 0 only, as are report and the meter's peak
    report: Report | None = None
    meter: FlopsMeter | None = None
    t0: float = 0.0


def _check_run(cfg: Config, verify: bool, rank: int, world: int) -> Plan:
    """Preflight on rank 0, its plan on every rank; rank 0 prints its notes, and the line saying there is
    nothing to train, unless `looped_lm train` printed them before it started the launcher."""
    plan = on_rank0(lambda: preflight(cfg, verify, world))
    if rank == 0 and not os.environ.get(PREFLIGHT_DONE):
        for note in plan.notes:
            print(f"note: {note}", flush=True)
        if nothing_to_train(plan, cfg):
            print(nothing_to_train(plan, cfg), flush=True)
    return plan


def _open_streams(cfg: Config, plan: Plan):
    """The training and validation batches: tokens, images or characters (see data/batches)."""
    return open_batches(cfg, plan.data_dir, TRAIN), open_batches(cfg, plan.data_dir, VAL)


def _build_model(cfg: Config, plan: Plan, rank: int, world: int):
    """The model, the same on every rank: the checkpoint's weights and state on a resume, else a pretrained
    source's (model.init_from) or a fresh init. Block parallel: only this rank's blocks are trainable."""


    torch.manual_seed(cfg.train.seed)  # identical init on every rank
    model = build_model(parallel.rank_config(cfg, rank, world) if cfg.train.mode == "block_parallel" else cfg,
                        plan.vocab_size)
    if plan.manifest is not None:
        _restore_model(model, cfg, plan)
    elif init_source(cfg):  # a fresh run from a pretrained checkpoint (preflight checked it maps)
        plan.base = init_from_pretrained(model, cfg)
    torch.manual_seed(cfg.train.seed + 1 + rank)  # noise draws (sigma, z, slots) differ across ranks
    return model


def _write_conversion(cfg: Config, plan: Plan, rank: int, world: int) -> Path:
    """train.max_steps 0: the model as built (model.init_from's conversion, or the init), written by rank 0 as
    a weights-only step-0 checkpoint: every verb reads it, and a run resumes from it as a fresh run from the
    same source would start (no optimizer or RNG state exists before the first step)."""
    model = _build_model(cfg, plan, rank, world)
    out_dir = Path(cfg.train.out_dir)
    final = out_dir / ckpt_io.step_dir_name(0)
    if rank == 0:
        tmp = ckpt_io.tmp_dir_for(out_dir, 0)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        manifest = run_manifest(cfg, plan, model, 0, 0, world, conversion=True)
        final = ckpt_io.finalize(out_dir, 0, model, manifest, cfg.train.keep_last)
        print(f"step 0: wrote the model as built ({init_source(cfg) or 'its init'}), weights only, to {final}; "
              "eval, generate, serve and export read it, and a run with train.max_steps > 0 resumes from it",
              flush=True)
    dist.barrier()
    return final


def _restore_model(model, cfg: Config, plan: Plan) -> None:
    """A resume: the checkpoint's model state (edges, curve...), an adapter run's base, and the weights
    (checkpoints of DeepSpeed's own layout: with the optimizer state, in _resume_state)."""
    manifest = plan.manifest
    try:
        with torch.device("meta"):  # the saved state must build this model (edges per block...): free
            build_model(cfg, plan.vocab_size, manifest.state)
        model.restore_state(manifest.state)
    except (UserError, ValueError, TypeError) as e:  # edges or curve that do not fit this model
        msg = str(e) if str(e).startswith("cannot resume") else f"cannot resume from {plan.resume}: {e}"
        raise UserError(msg) from None
    if cfg.train.lora_rank:  # adapters resume over their base (sha256-verified)
        load_base(model, cfg, manifest.base or {"path": cfg.model.init_from, "sha256": "(not recorded)"})
    if manifest.layout == OPTIMIZER_BY_UNIT:
        tensor_files.load_weights(model, Path(plan.resume) / ckpt_io.WEIGHTS, recorded_dtypes=manifest.weights_dtypes)


def _start_engine(run: _Run) -> None:
    """Compile (train.compile), our optimizer and its schedule, the DeepSpeed engine around them, block
    parallel's gradient exchange, and train_step's runner."""

    cfg, t, model = run.cfg, run.cfg.train, run.model
    if devices.compile_enabled(t.compile, run.device.type):
        compile_for_training(model, kind_of(cfg))
    optimizer = BlockwiseAdamW(param_groups(model, t.weight_decay), devices.adamw_implementation(run.device.type), lr=t.lr,
                               betas=(t.beta1, t.beta2), eps=1e-8)
    for group in optimizer.param_groups:
        group["initial_lr"] = t.lr
    # the schedule is a function of the step: a resume starts it where the checkpoint stopped
    run.schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.lr, t.min_lr) / t.lr,
        last_epoch=run.start_step - 1)
    run.engine, _, _, _ = deepspeed.initialize(model=TrainingModule(model, t.seed), optimizer=optimizer,
                                               lr_scheduler=run.schedule, config=deepspeed_config(cfg, run.world),
                                               dist_init_required=False)
    exchange = None
    if t.mode == "block_parallel":
        run.engine.enable_backward_allreduce = False  # the engine's all-reduce would mix different blocks
        exchange = parallel.BlockParallel(cfg, model, dist)
    # ZeRO wraps our optimiser: train_step keeps the handle on ours (the units it updates)
    run.runner = DeepSpeedRunner(run.engine, (lambda: exchange.reduce(optimizer.active_units)) if exchange else None,
                                 optimizer, skip_each_step=t.skip_nonfinite > 0)
    run.runner.step = run.start_step
    run.optimizer, run.exchange = optimizer, exchange


def _resume_state(run: _Run) -> None:
    """A resume: the optimizer state (by parameter name, or DeepSpeed's own files), this rank's RNG state
    and the tokens seen so far."""
    manifest = run.plan.manifest
    if manifest is None:
        return
    if manifest.conversion is not None:  # before any step: a fresh optimizer and the seed's RNG, as a fresh run
        if run.rank == 0:
            print(f"resumed from {run.plan.resume} (the model as built, step 0: a fresh optimizer)", flush=True)
        return
    resume_from = Path(run.plan.resume)
    if manifest.layout == OPTIMIZER_BY_UNIT:
        states = {unit: ckpt_io.read_unit_state(resume_from, unit)
                  for unit in sorted({g["unit"] for g in run.optimizer.param_groups})}
        zero = run.engine.optimizer if run.cfg.deepspeed.zero_stage > 0 else None
        load_state_by_name(run.model, run.optimizer, states, zero)
    else:  # DeepSpeed's own files: the same ZeRO stage and world size (preflight checked)
        run.engine.load_checkpoint(str(resume_from / "optimizer"), tag="ds", load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
    rng_file = resume_from / "rng" / f"rank{run.rank}.pt"
    if rng_file.is_file():  # verified on rank 0; absent for ranks the saving run did not have
        tensor_files.set_rng_state(torch.load(rng_file, weights_only=False))
    run.tokens_seen = manifest.tokens_seen
    if run.rank == 0:
        print(f"resumed from {resume_from} at step {run.start_step}", flush=True)


def _open_outputs(run: _Run, stop_after: int) -> None:
    """Where the loop ends (--stop-after), rank 0's metrics log and progress report, and the MFU meter."""


    cfg, t, rank = run.cfg, run.cfg.train, run.rank
    run.logger = MetricsLogger(Path(t.out_dir), rank, run.start_step) if rank == 0 else None
    if run.logger is not None and run.plan.changes:
        run.logger.log(run.start_step, {"resume_changes": run.plan.changes})
    run.tokens_per_step = t.batch_size * t.grad_accum * run.world * run.train_stream.units_per_example
    run.end_step = t.max_steps if stop_after <= 0 else min(t.max_steps, run.start_step + stop_after)
    run.report = Report(cfg, run.start_step, run.tokens_per_step, run.train_stream.unit) if rank == 0 else None
    run.last_ckpt = Path(run.plan.resume) if run.plan.resume else None
    peak = peak_flops(run.device, torch.bfloat16 if cfg.deepspeed.bf16 else torch.float32, t.peak_tflops) \
        if rank == 0 else 0.0
    run.meter = FlopsMeter(StepFlops(cfg, run.plan.vocab_size), run.world, peak)
    run.t0 = time.perf_counter()


def _loop(run: _Run) -> Path | None:
    """Steps start_step..end_step, each with what falls due after it; then the summary. The logs are closed
    however the loop ends. Returns the last checkpoint."""
    try:
        for step in range(run.start_step, run.end_step):
            loss_sum, metrics, lr = _step(run, step)
            _after_step(run, step + 1, loss_sum, metrics, lr)
        if run.report is not None:
            run.report.summary(run.end_step, run.last_ckpt)
    except BaseException:
        failed = True  # the run's own error is the one line: closing the logs must not add another
        raise
    else:
        failed = False
    finally:
        if run.report is not None:
            run.report.close()
        if run.logger is not None:
            run.logger.close(quiet=failed)
    return run.last_ckpt


def _step(run: _Run, step: int):
    """One optimiser step over train.grad_accum micro-batches; (loss, metrics, lr), the loss kept on the
    device. A non-finite step in skip mode made no update: it stops the run, or is skipped within budget."""
    t, rank = run.cfg.train, run.rank
    lr = run.schedule.get_last_lr()[0]  # this step's (engine.step advances the schedule)
    batches = (run.train_stream.get_batch(t.batch_size, t.seed, step, micro, rank) for micro in range(t.grad_accum))
    result = train_step(run.model, run.optimizer, run.runner, (on_device(batch, run.device) for batch in batches),
                        step, t.seed)
    loss_sum, metrics = result.loss, result.metrics
    if not run.runner.finite:  # skip mode: no update was made (DeepSpeedRunner): stop, or skip within the budget
        run.skipped += 1
        nonfinite_step(run.runner, step + 1, run.skipped, t.skip_nonfinite, run.last_ckpt, run.logger, run.report,
                       rank)
    run.meter.add(metrics.get("block", metrics.get("recurrence")))  # host ints: what the step cost
    if run.exchange is not None:  # every block trained this step: log each one's loss

        per_block = run.exchange.block_losses(loss_sum, metrics["block"], run.device)  # on the device
        loss_sum = torch.nanmean(torch.stack(list(per_block.values())))  # the blocks trained this step
        metrics = {"blocks": sorted(per_block), **{f"loss_block{b}": v for b, v in per_block.items()}}
    return loss_sum, metrics, lr


def _after_step(run: _Run, done: int, loss_sum, metrics: dict, lr: float) -> None:
    """What falls due once `done` steps are done: the non-finite check, the report and log (log steps), the
    blocks' weights to every rank, the CE curve, validation and a save. The device is read only at log,
    eval, curve and save steps."""
    t, d = run.cfg.train, run.cfg.diffusion
    log_now = done % t.log_every == 0 or done == run.end_step
    reads_all = (t.eval_every and done % t.eval_every == 0) or (t.save_every and done % t.save_every == 0) \
        or done == run.end_step
    curve_now = run.model.uses_curve() and done % d.curve_every == 0 and (d.curve_until == 0 or done <= d.curve_until)
    if log_now or reads_all or curve_now:  # stop mode: the steps since the last read, checked in one read
        bad = run.runner.first_nonfinite()
        if bad is not None:
            stop_nonfinite(run.runner, bad, done, run.last_ckpt, run.rank)
    if run.report is not None:
        run.report.step(loss_sum, metrics, show=log_now)
    if run.logger is not None and log_now:
        _log_step(run, done, loss_sum, metrics, lr)
    # each block's weights from the rank that trains it: before anything reads the whole model, and
    # after every step under context stacked, where block b's next step runs blocks < b forward
    if run.exchange is not None and (reads_all or d.context == "stacked"):
        run.exchange.sync_blocks()
    if curve_now:
        _refresh_curve(run, done)
    if t.eval_every and done % t.eval_every == 0:
        _validate(run, done)
    if (t.save_every and done % t.save_every == 0) or done == run.end_step:
        _save(run, done)


def _log_step(run: _Run, done: int, loss_sum, metrics: dict, lr: float) -> None:
    """Rank 0, a log step: the values of this step, read back from the device here only."""
    elapsed = time.perf_counter() - run.t0
    values = {k: float(v) if hasattr(v, "item") else v for k, v in metrics.items()}
    values = {k: v for k, v in values.items() if not (isinstance(v, float) and math.isnan(v))}  # untrained blocks
    if "blocks" in values:  # block parallel: the blocks some rank trained this step
        values["blocks"] = [b for b in values["blocks"] if f"loss_block{b}" in values]
    rate = run.meter.read()
    run.logger.log(done, {**({"loss": float(loss_sum)} if run.runner.finite else {}), "lr": lr,
                          "tokens": _tokens(run, done),
                          "tokens_per_s": (done - run.start_step) * run.tokens_per_step / max(elapsed, 1e-9),
                          **rate, **values})
    if run.report is not None and "mfu" in rate:
        run.report.mfu = rate["mfu"]


def _tokens(run: _Run, done: int) -> int:
    """Tokens (or the data's units) seen once `done` steps are done."""
    return run.tokens_seen + (done - run.start_step) * run.tokens_per_step


def _refresh_curve(run: _Run, done: int) -> None:
    """Re-measure CE(sigma) on the training stream (never validation data): the edges and block shares follow."""
    curve = refresh_curve(run.model, run.train_stream, run.cfg, run.device, run.rank, done)
    run.meter.add_curve()
    if run.logger is not None:
        run.logger.log(done, {"edges": run.model.edges, "curve_ce": curve["ce"]})


def _validate(run: _Run, done: int) -> None:
    """The held-out loss (train.eval_every), logged and reported by rank 0."""
    val = evaluate_loss(run.model, run.val_stream, run.cfg, run.device, run.rank)
    if run.logger is not None:
        run.logger.log(done, {"val_loss": val})
        run.report.validation(done, val)


def _save(run: _Run, done: int) -> None:
    """A checkpoint (train.save_every, and the last step of this launch)."""
    out_dir = Path(run.cfg.train.out_dir)
    run.last_ckpt = save(run.engine, run.model, run.optimizer, run.cfg, run.plan, out_dir, done, _tokens(run, done),
                         run.rank)
    if run.report is not None:
        run.report.line(f"step {done}: saved {run.last_ckpt}")


def stop_nonfinite(runner, bad: int, done: int, last_ckpt, rank: int = 0) -> None:
    """Stop mode (train.skip_nonfinite 0): step `bad`'s loss or gradient norm was not finite, found at the
    read at step `done` (a log, eval, curve or save step): stop before anything reads or saves the weights."""
    kept = f"the newest checkpoint, {last_ckpt}, is untouched" if last_ckpt else "no checkpoint was written"
    err = RunFailure(f"step {bad}: {runner.nonfinite_reason()}; stopped at step {done}, before any save ({kept}); "
                     "lower train.lr or raise train.grad_clip, or set train.skip_nonfinite: N to skip up to N such "
                     "steps")
    err.quiet = rank != 0  # every rank stops (the flags are all-reduced); rank 0 says it
    raise err


def refresh_curve(model, train_stream, cfg: Config, device, rank: int, step: int) -> dict | None:
    """Measure CE(sigma) on rank 0 and give every rank the same curve (so every rank keeps the same edges
    and draws the same blocks). It is measured on a fixed TRAINING batch (step index -2, which the loop
    never draws): the validation split never steers training."""
    curve = [None]
    if rank == 0:
        was_training = model.training
        model.eval()
        x, y = on_device(train_stream.get_batch(cfg.train.batch_size, cfg.train.seed, -2, 0, 0), device)
        curve[0] = model.measure_curve(x, y, seed=cfg.train.seed + step)
        model.train(was_training)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(curve, src=0)
    model.apply_curve(curve[0])
    return curve[0]


def nonfinite_step(runner, done: int, skipped: int, budget: int, last_ckpt, logger, report, rank: int = 0) -> None:
    """A step whose loss or gradient norm was not finite (it made no update): the run stops with one
    line naming the step (exit 1), unless train.skip_nonfinite allows `skipped` such steps; a skipped
    step is logged (metrics.jsonl `skipped_nonfinite`) and said."""
    reason = runner.nonfinite_reason()
    if skipped > budget:
        kept = f"the newest checkpoint, {last_ckpt}, is untouched" if last_ckpt else "no checkpoint was written"
        allowed = f"{budget} non-finite step{'s' if budget != 1 else ''} skipped already (train.skip_nonfinite)" \
            if budget else "set train.skip_nonfinite: N to skip up to N such steps"
        err = RunFailure(f"step {done}: {reason}; stopped before the optimizer update ({kept}); lower train.lr or "
                         f"raise train.grad_clip, or {allowed}")
        err.quiet = rank != 0  # every rank stops (the flag is all-reduced); rank 0 says it
        raise err
    if logger is not None:
        logger.log(done, {"skipped_nonfinite": skipped, "nonfinite": reason})
    if report is not None:
        report.line(f"step {done}: {reason}: skipped, no update ({skipped} of train.skip_nonfinite {budget})")


def on_device(batch, device):
    """(x, y) moved to the device; y may be None (mdm: the targets are x)."""
    x, y = batch
    return x.to(device), (None if y is None else y.to(device))


def evaluate_loss(model, stream, cfg: Config, device, rank: int) -> float:
    """Mean held-out loss over a fixed set of batches (the same ones at every evaluation)."""
    was_training = model.training
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(cfg.train.eval_batches):
            x, y = on_device(stream.get_batch(cfg.train.batch_size, cfg.train.seed, -1, i, rank), device)
            losses.append(model.validation_loss(x, y, seed=cfg.train.seed + i).item())
    model.train(was_training)
    value = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)

"""The trainer: `looped_lm train --config X.yaml`, which runs `deepspeed --module looped_lm.train ...`;
`deepspeed looped_lm/train.py --config X.yaml [--set section.key=value ...]` works too, and so does one
process without the launcher (`python -m looped_lm.train --config X.yaml`).
Every model kind trains through the same step (training.train_step, on models/contract.py `Trainable`):
    training_loss(x, y, step, seed) -> (loss, metrics)    one micro-batch
    step_units(step, seed) -> set of unit names | None    which parameter units this step updates
    validation_loss(x, y, seed) -> loss                   held-out loss (DB models: at sigma_hi)
    checkpoint_state() / restore_state(saved)             metadata saved in the manifest (edges...)
DeepSpeed owns the optimiser, gradient accumulation, clipping and ZeRO; the model knows nothing of it.
`train.mode: block_parallel` (looped_lm/parallel.py): each rank builds the model with only its own blocks
trainable, the engine's all-reduce is off, and `BlockParallel` exchanges and clips the gradients before
the engine's optimiser step. Checkpoints keep the optimiser state by parameter name (optim.state_by_name),
so a run resumes on another world size, ZeRO stage or mode.

Before anything is built, `preflight.preflight` checks what the run reads and writes (rank 0; and
`looped_lm train` before it starts the launcher).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from looped_lm import checkpoint as ckpt_io
from looped_lm import devices
from looped_lm import parallel
from looped_lm.config import Config, describe_fields, init_source, load_config
from looped_lm.kinds import kind_of
from looped_lm.errors import UserError
from looped_lm.data.batches import data_source_string
from looped_lm.preflight import Plan, describe_os_error, nothing_to_train, preflight

__all__ = ["Plan", "data_source_string", "main", "preflight", "train"]

PREFLIGHT_DONE = "LOOPED_LM_PREFLIGHT_DONE"
# set by `looped_lm train` on one node: the ranks meet through this file (torch's FileStore), so no
# rendezvous port listens on the machine's interfaces (torch's TCPStore binds all of them)
RENDEZVOUS_FILE = "LOOPED_LM_RENDEZVOUS_FILE"
RESUMING_WITH = "resuming with changes (train.resume_changes: allow)"  # set by `looped_lm train`: its process printed the notes


class RunFailure(Exception):
    """A failure mid-run that is not bad input (a full disk, a read-only file system): exit code 1."""


def add_arguments(p) -> None:
    """The trainer's flags, shared by `looped_lm train` and `deepspeed looped_lm/train.py`."""
    p.add_argument("--config", help="YAML run config (see configs/README.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable)")
    p.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="save and exit after N steps of this launch (preemptible jobs); 0 = run to max_steps")
    p.add_argument("--help-config", nargs="?", const="", default=None, metavar="KIND",
                   help="list every config field and exit (KIND: only that model.kind's fields)")
    ckpt_io.add_verify_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="also show the DeepSpeed launcher's own log, library deprecation warnings and tracebacks")


def forward_args(args) -> list[str]:
    """The trainer's own flags of a parsed `looped_lm train`, as the argv the launcher hands each rank."""
    argv = ["--config", args.config] if args.config else []
    for item in args.set:
        argv += ["--set", item]
    if args.stop_after:
        argv += ["--stop-after", str(args.stop_after)]
    return argv + ["--no-verify"] * args.no_verify + ["--verbose"] * args.verbose


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="looped_lm train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args) -> Config:
    if args.config is None and not args.set:
        raise UserError("give --config FILE (and/or --set section.key=value overrides)")
    if args.stop_after < 0:
        raise UserError(f"--stop-after must be >= 0 (got {args.stop_after})")
    return load_config(args.config, args.set)


# ---------------------------------------------------------------------------------------------
# distributed set-up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed():
    """Set up torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU; one process works too."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # launched without the deepspeed launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import deepspeed
    import deepspeed.ops

    # init_distributed otherwise JIT-compiles a shared-memory comm op with g++ (~1 min, needs a compiler)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = devices.dist_backend("cuda" if cuda else "cpu")
    store = os.environ.get(RENDEZVOUS_FILE)
    if store:  # one node: a file rendezvous, and gloo's and NCCL's own sockets on loopback
        if Path("/sys/class/net/lo").exists():
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        deepspeed.init_distributed(dist_backend=backend, init_method=f"file://{store}",
                                   rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        deepspeed.init_distributed(dist_backend=backend)
    device = devices.rank_device(cuda, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # no CPU meaning: NCCL and every later allocation use this GPU
    return device


def on_rank0(fn):
    """fn() on rank 0, its result (or its UserError) on every rank: one rank reads and verifies."""
    import deepspeed.comm as dist

    box = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except UserError as e:
            box[1] = str(e)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        err = UserError(box[1])
        err.quiet = dist.get_rank() != 0  # rank 0 prints it
        raise err
    return box[0]


def bf16_autocast(cfg: Config) -> bool:
    """bf16 as autocast over fp32 weights (not DeepSpeed's pure-bf16 weights): block parallel, and the
    supporting modules, whose float inputs (images, noise levels) meet the weights directly."""
    return cfg.deepspeed.bf16 and (cfg.train.mode == "block_parallel" or kind_of(cfg).offers("autocast"))


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        # block parallel: parallel.BlockParallel clips each block's gradient before the shared average
        "gradient_clipping": 0.0 if t.mode == "block_parallel" else t.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        # bf16 at ZeRO 0 is DeepSpeed's pure-bf16 path (bf16 weights and Adam state); block parallel (always
        # ZeRO 0) and the modules run bf16 compute under autocast instead: fp32 weights, gradients, optimizer state
        "bf16": {"enabled": cfg.deepspeed.bf16 and not bf16_autocast(cfg)},
        "torch_autocast": {"enabled": bf16_autocast(cfg), "dtype": "bfloat16"},
        "steps_per_print": 10 ** 9,  # our own logging
        "wall_clock_breakdown": False,
        # BlockwiseAdamW is torch AdamW plus per-unit skipping; ZeRO 1/2 keep its group dicts
        "zero_allow_untested_optimizer": True,
    }


class DeepSpeedRunner:
    """train_step's runner under DeepSpeed: the engine scales for accumulation, clips, reduces across
    ranks and steps the optimiser at the accumulation boundary. `before_update` runs just before that
    optimiser step (block parallel: the gradient exchange that replaces the engine's all-reduce).

    With `skip_each_step` (train.skip_nonfinite > 0), a step whose loss or gradient norm is not finite
    makes no update (`finite` is False afterwards): the optimiser is told that no unit is active, so NaN
    never reaches the weights or the optimizer state; deciding that needs the host, one read per step.
    Otherwise (the default: such a step stops the run) nothing is read: each step's flag is kept on the
    device and `first_nonfinite()` reads them at the trainer's log, eval and save steps, before anything
    is saved, so a step makes no host sync at all."""

    def __init__(self, engine, before_update=None, optimizer=None, skip_each_step: bool = True):
        self.engine, self.before_update, self.optimizer = engine, before_update, optimizer
        self.skip_each_step = skip_each_step
        self.step_loss = None  # the step's summed micro-batch losses, kept on the device (no host sync)
        self.finite, self.loss_value, self.grad_norm = True, None, None
        self.pending: list = []  # (step, ok, loss, norm) on the device, since the last first_nonfinite()
        self.step = 0

    def loss(self, x, y, step: int):
        loss = self.engine(x, y, step)
        return loss, self.engine.module.last_metrics

    def backward(self, loss) -> None:
        self.step_loss = loss.detach() if self.step_loss is None else self.step_loss + loss.detach()
        self.engine.backward(loss)

    def micro_step(self) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary:
            if self.before_update is not None:
                self.before_update()
            self.step += 1
            self.finite = self._finite_step() if self.skip_each_step else self._record_step()
            if not self.finite and self.optimizer is not None:
                self.optimizer.set_active_units(())  # BlockwiseAdamW: no unit active = no update at all
        self.engine.step()
        if boundary:
            # ZeRO 1/2 hold the gradients in their own partitions (not p.grad): their optimizer checks them
            # and skips the step itself on a non-finite one (its `overflow` flag, already on the host)
            if getattr(self.engine.optimizer, "overflow", False) is True and self.finite:
                self.finite, self.grad_norm = False, float("nan")
            self.step_loss = None

    def _flags(self):
        """(ok, loss, norm): this step's loss and gradient norm and whether both are finite on every rank
        (all-reduced), as device tensors."""
        import torch

        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)])) \
            if grads else torch.zeros((), device=self.step_loss.device)
        loss = self.step_loss.float().reshape(())
        ok = torch.isfinite(torch.stack([loss, norm.to(loss.device)])).all().float()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return ok, loss, norm

    def _record_step(self) -> bool:
        """Stop mode: keep the flag for `first_nonfinite`; the update goes ahead (no host sync)."""
        self.pending.append((self.step, *self._flags()))
        return True

    def first_nonfinite(self) -> int | None:
        """The first step since the last call whose loss or gradient norm was not finite (None: every one
        was): ONE read for all of them. Its values are kept for `nonfinite_reason`."""
        import torch

        pending, self.pending = self.pending, []
        if not pending:
            return None
        oks = torch.stack([ok for _, ok, _, _ in pending])
        if bool((oks == 1.0).all()):
            return None
        i = int((oks < 1.0).nonzero()[0, 0])
        step, _, loss, norm = pending[i]
        self.loss_value, self.grad_norm = float(loss), float(norm)
        return step

    def _finite_step(self) -> bool:
        """Are this step's loss and gradient norm finite, on every rank?

        THE ONE DELIBERATE HOST SYNC of an optimiser step: the loss and the gradient norm are fused into
        one flag on the device (all-reduced over ranks, so every rank skips or stops together) and read
        once. The values themselves are read only when the flag says something is wrong."""
        self.loss_value = self.grad_norm = None
        ok, loss, norm = self._flags()
        if ok.item() == 1.0:
            return True
        self.loss_value, self.grad_norm = float(loss), float(norm)
        return False

    def nonfinite_reason(self) -> str:
        """'loss is nan' / 'gradient norm is inf' (another rank's, when both are finite here)."""
        import math

        loss, norm = self.loss_value, self.grad_norm
        if loss is not None and not math.isfinite(loss):
            return f"loss is {loss}" + (f" (gradient norm {norm})" if norm is not None else "")
        if norm is not None and not math.isfinite(norm):
            return f"gradient norm is {norm} (loss {loss})" if loss is not None else f"gradient norm is {norm}"
        return "another rank's loss or gradient norm is not finite"


def refresh_curve(model, train_stream, cfg: Config, device, rank: int, step: int) -> dict | None:
    """Measure CE(sigma) on rank 0 and give every rank the same curve (so every rank keeps the same edges
    and draws the same blocks). It is measured on a fixed TRAINING batch (step index -2, which the loop
    never draws): the validation split never steers training."""
    import deepspeed.comm as dist

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


# ---------------------------------------------------------------------------------------------
# the run: its phases (_train), then the loop


def train(cfg: Config, stop_after: int = 0, verify: bool = True) -> Path | None:
    """Run training; return the final checkpoint directory (on every rank)."""
    device = init_distributed()
    import deepspeed.comm as dist

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
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = _check_run(cfg, verify, rank, world)
    if nothing_to_train(plan, cfg):
        return Path(plan.resume)
    if cfg.train.max_steps == 0:
        return _write_conversion(cfg, plan, rank, world)
    run = _Run(cfg, device, rank, world, plan, *_open_streams(cfg, plan))
    run.model = _build_model(cfg, plan, rank, world)
    run.start_step = plan.manifest["step"] if plan.manifest is not None else 0
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
    from looped_lm.data.batches import open_batches

    return open_batches(cfg, plan.data_dir, "train"), open_batches(cfg, plan.data_dir, "val")


def _build_model(cfg: Config, plan: Plan, rank: int, world: int):
    """The model, the same on every rank: the checkpoint's weights and state on a resume, else a pretrained
    source's (model.init_from) or a fresh init. Block parallel: only this rank's blocks are trainable."""
    import torch

    from looped_lm.models import build_model

    torch.manual_seed(cfg.train.seed)  # identical init on every rank
    model = build_model(parallel.rank_config(cfg, rank, world) if cfg.train.mode == "block_parallel" else cfg,
                        plan.vocab_size)
    if plan.manifest is not None:
        _restore_model(model, cfg, plan)
    elif init_source(cfg):  # a fresh run from a pretrained checkpoint (preflight checked it maps)
        from looped_lm.pretrained import init_from_pretrained

        plan.base = init_from_pretrained(model, cfg)
    torch.manual_seed(cfg.train.seed + 1 + rank)  # noise draws (sigma, z, slots) differ across ranks
    return model


def _write_conversion(cfg: Config, plan: Plan, rank: int, world: int) -> Path:
    """train.max_steps 0: the model as built (model.init_from's conversion, or the init), written by rank 0 as
    a weights-only step-0 checkpoint: every verb reads it, and a run resumes from it as a fresh run from the
    same source would start (no optimizer or RNG state exists before the first step)."""
    import deepspeed.comm as dist

    model = _build_model(cfg, plan, rank, world)
    out_dir = Path(cfg.train.out_dir)
    final = out_dir / ckpt_io.step_dir_name(0)
    if rank == 0:
        tmp = ckpt_io.tmp_dir_for(out_dir, 0)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        manifest = {"config": cfg.to_dict(), "model_kind": cfg.model.kind, "vocab_size": plan.vocab_size,
                    "tokenizer": plan.tokenizer, "model_state": model.checkpoint_state(),
                    "data": {"dir": plan.data_dir, "position": {"step": 0, "tokens_seen": 0}},
                    "world_size": world, "optimizer_layout": "units",
                    "conversion": {"init_from": init_source(cfg) or None}}
        if getattr(plan, "base", None) is not None:
            manifest["base"] = plan.base
        if kind_of(cfg).offers("merge"):
            manifest["ownership"] = {"blocks": parallel.trained_blocks(cfg)}
        final = ckpt_io.finalize(out_dir, 0, model, manifest, cfg.train.keep_last)
        print(f"step 0: wrote the model as built ({init_source(cfg) or 'its init'}), weights only, to {final}; "
              "eval, generate, serve and export read it, and a run with train.max_steps > 0 resumes from it",
              flush=True)
    dist.barrier()
    return final


def _restore_model(model, cfg: Config, plan: Plan) -> None:
    """A resume: the checkpoint's model state (edges, curve...), an adapter run's base, and the weights
    (checkpoints of DeepSpeed's own layout: with the optimizer state, in _resume_state)."""
    import torch

    from looped_lm.models import build_model

    manifest = plan.manifest
    try:
        with torch.device("meta"):  # the saved state must build this model (edges per block...): free
            build_model(cfg, plan.vocab_size, manifest.get("model_state", {}))
        model.restore_state(manifest.get("model_state", {}))
    except (UserError, ValueError, TypeError) as e:  # edges or curve that do not fit this model
        msg = str(e) if str(e).startswith("cannot resume") else f"cannot resume from {plan.resume}: {e}"
        raise UserError(msg) from None
    if cfg.train.lora_rank:  # adapters resume over their base (sha256-verified)
        from looped_lm.pretrained import load_base

        load_base(model, cfg, manifest.get("base") or {"path": cfg.model.init_from, "sha256": "(not recorded)"})
    if ckpt_io.optimizer_layout(manifest) == "units":
        ckpt_io.load_weights(model, Path(plan.resume) / ckpt_io.WEIGHTS, recorded_dtypes=manifest.get("weights_dtypes"))


def _start_engine(run: _Run) -> None:
    """Compile (train.compile), our optimizer and its schedule, the DeepSpeed engine around them, block
    parallel's gradient exchange, and train_step's runner."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from looped_lm.compile import compile_for_training
    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
    from looped_lm.training import TrainingModule

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
    import torch

    from looped_lm.optim import load_state_by_name

    manifest = run.plan.manifest
    if manifest is None:
        return
    if "conversion" in manifest:  # before any step: a fresh optimizer and the seed's RNG, as a fresh run
        if run.rank == 0:
            print(f"resumed from {run.plan.resume} (the model as built, step 0: a fresh optimizer)", flush=True)
        return
    resume_from = Path(run.plan.resume)
    if ckpt_io.optimizer_layout(manifest) == "units":
        states = {unit: ckpt_io.read_unit_state(resume_from, unit)
                  for unit in sorted({g["unit"] for g in run.optimizer.param_groups})}
        zero = run.engine.optimizer if run.cfg.deepspeed.zero_stage > 0 else None
        load_state_by_name(run.model, run.optimizer, states, zero)
    else:  # DeepSpeed's own files: the same ZeRO stage and world size (preflight checked)
        run.engine.load_checkpoint(str(resume_from / "optimizer"), tag="ds", load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
    rng_file = resume_from / "rng" / f"rank{run.rank}.pt"
    if rng_file.is_file():  # verified on rank 0; absent for ranks the saving run did not have
        ckpt_io.set_rng_state(torch.load(rng_file, weights_only=False))
    run.tokens_seen = manifest.get("data", {}).get("position", {}).get("tokens_seen", 0)
    if run.rank == 0:
        print(f"resumed from {resume_from} at step {run.start_step}", flush=True)


def _open_outputs(run: _Run, stop_after: int) -> None:
    """Where the loop ends (--stop-after), rank 0's metrics log and progress report, and the MFU meter."""
    import torch

    from looped_lm.mfu import StepFlops, peak_flops

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
    from looped_lm.training import train_step

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
        import torch

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


class FlopsMeter:
    """MFU between log steps: each step's FLOPs from the cost model (looped_lm/mfu.py), keyed by what decides
    them (the DB block, huginn's r; host values, no sync), and the curve refreshes', over the wall time, the
    world and the peak."""

    def __init__(self, step_flops, world: int, peak: float):
        self.step_flops, self.world, self.peak = step_flops, world, peak
        self.flops, self.t0 = 0.0, time.perf_counter()

    def add(self, key) -> None:
        flops = self.step_flops(key)
        self.flops = None if flops is None or self.flops is None else self.flops + self.world * flops

    def add_curve(self) -> None:
        """A CE(sigma) curve refresh: rank 0 measures it, so it counts once, not once per rank."""
        flops = self.step_flops.curve()
        if flops is not None and self.flops is not None:
            self.flops += flops

    def read(self) -> dict:
        """{"flops_per_s", "mfu"} since the last read (what is known), and start a new interval."""
        now = time.perf_counter()
        seconds, flops = now - self.t0, self.flops
        self.flops, self.t0 = 0.0, now
        if flops is None or seconds <= 0:
            return {}
        rate = {"flops_per_s": flops / seconds}
        if self.peak:
            rate["mfu"] = flops / seconds / (self.peak * self.world)
        return rate


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


class SmoothedLoss:
    """Moving averages of the training loss, one per block: DiffusionBlocks steps alternate blocks whose
    losses differ by an order of magnitude, so one average (or the last value) jumps between them.
    Debiased like Adam's moments, so the first steps read right. The sums and counts stay on the device
    (a loss is a device tensor): `values()` reads them, at log steps only."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.sums, self.counts = beta, {}, {}

    def update(self, loss, metrics: dict) -> None:
        if "blocks" in metrics:  # block parallel: every block's loss of this step
            for b in metrics["blocks"]:
                self._add(f"b{b}", metrics[f"loss_block{b}"])
        else:
            self._add(f"b{metrics['block']}" if "block" in metrics else "", loss)

    def _add(self, key: str, loss) -> None:
        import torch

        loss = torch.as_tensor(loss, dtype=torch.float64)
        finite = torch.isfinite(loss)  # a non-finite step (skipped, or about to stop the run) must not poison it
        old = self.sums.get(key, torch.zeros((), dtype=torch.float64, device=loss.device))
        self.sums[key] = torch.where(finite, self.beta * old + (1 - self.beta) * loss.nan_to_num(0.0), old)
        self.counts[key] = self.counts.get(key, 0) + finite.double()

    def values(self) -> dict[str, float]:
        return {k: float(self.sums[k] / (1 - self.beta ** self.counts[k])) for k in sorted(self.sums)
                if float(self.counts[k]) > 0}

    def __str__(self) -> str:
        return " ".join(f"{k} {v:.4f}".strip() for k, v in self.values().items())


class Report:
    """What rank 0 prints: a progress bar with the smoothed loss per block, and plain lines for
    validation, saves and the end of the run (nanoGPT's `step N: train loss X, val loss Y`)."""

    def __init__(self, cfg: Config, start_step: int, tokens_per_step: int, unit: str = "tokens"):
        self.cfg, self.start, self.tokens_per_step, self.unit = cfg, start_step, tokens_per_step, unit
        self.loss, self.val, self.done = SmoothedLoss(), None, start_step
        self.mfu: float | None = None  # the last log step's (FlopsMeter)
        self.t0 = time.perf_counter()
        self.bar = None
        if cfg.train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def tokens_per_s(self) -> float:
        return (self.done - self.start) * self.tokens_per_step / max(time.perf_counter() - self.t0, 1e-9)

    def step(self, loss, metrics: dict, show: bool = True) -> None:
        """Count a step; its loss joins the averages on the device. `show` (log steps): read them for the bar."""
        self.loss.update(loss, metrics)
        self.done += 1
        if self.bar is not None:
            if show:
                rate = "tok" if self.unit == "tokens" else self.unit
                mfu = f", mfu {100 * self.mfu:.1f}%" if self.mfu is not None else ""
                self.bar.set_postfix_str(f"loss {self.loss}, {self.tokens_per_s():,.0f} {rate}/s{mfu}", refresh=False)
            self.bar.update(1)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def validation(self, step: int, val: float) -> None:
        self.val = (step, val)
        self.line(f"step {step}: train loss {self.loss}, val loss {val:.4f}")

    def summary(self, end_step: int, last_ckpt: Path | None) -> None:
        seconds = time.perf_counter() - self.t0
        minutes, secs = divmod(int(round(seconds)), 60)
        val = f", val loss {self.val[1]:.4f} (step {self.val[0]})" if self.val else ""
        stopped = "" if end_step >= self.cfg.train.max_steps else \
            f" (stopped at {end_step} of {self.cfg.train.max_steps}: the same command resumes)"
        self.line(f"done: steps {self.start}-{end_step} in {minutes}m{secs:02d}s, "
                  f"{self.tokens_per_s():,.0f} {self.unit}/s; train loss {self.loss}{val}; checkpoint {last_ckpt}"
                  f"{stopped}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def evaluate_loss(model, stream, cfg: Config, device, rank: int) -> float:
    """Mean held-out loss over a fixed set of batches (the same ones at every evaluation)."""
    import deepspeed.comm as dist
    import torch

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


def save(engine, model, optimizer, cfg: Config, plan: Plan, out_dir: Path, step: int, tokens: int, rank: int) -> Path:
    """Every rank writes its part into a temp dir (its RNG state, the optimiser units it is the writer of);
    rank 0 adds the weights and manifest and renames it. A failed save removes its temp dir and ends the
    run with one line (exit 1); a killed one leaves the temp dir, which the next start removes."""
    import deepspeed.comm as dist

    from looped_lm.optim import state_by_name

    tmp = ckpt_io.tmp_dir_for(out_dir, step)
    final = out_dir / ckpt_io.step_dir_name(step)
    world = dist.get_world_size()
    # a finite loss and gradient can still leave non-finite weights (an update too large): never save them.
    # Every rank holds the same weights here, so every rank stops together, before anything is written.
    bad = ckpt_io.nonfinite_tensor(model.state_dict().items())
    if bad is not None:
        kept = f"the newest checkpoint, {plan_last(out_dir, step)}, is untouched"
        err = RunFailure(f"step {step}: the weights hold NaN or Inf ({bad}) after this step's update: not saved "
                         f"({kept}); lower train.lr or raise train.grad_clip")
        err.quiet = rank != 0
        raise err
    try:
        if rank == 0:
            if tmp.exists():  # left by a crash during an earlier save of this step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        zero = engine.optimizer if cfg.deepspeed.zero_stage > 0 else None
        # fp32 master weights beside bf16 ones: ZeRO's partitions, or the fp32 weights under autocast
        master = cfg.deepspeed.bf16 and (zero is not None or bf16_autocast(cfg))
        states = state_by_name(model, optimizer, zero, dist, master=master)
        writers = parallel.unit_writers(cfg, world)
        for unit, (unit_step, tensors) in states.items():
            if writers.get(unit, 0) == rank:
                ckpt_io.write_unit_state(tmp, unit, unit_step, tensors)
        ckpt_io.write_rank_files(tmp, rank)
        dist.barrier()
        if rank == 0:
            manifest = {"config": cfg.to_dict(), "model_kind": cfg.model.kind, "vocab_size": plan.vocab_size,
                        "tokenizer": plan.tokenizer, "model_state": model.checkpoint_state(),
                        "data": {"dir": plan.data_dir,
                                 "position": {"step": step, "tokens_seen": tokens},
                                 "sampling": "stateless: batch(seed, step, micro_step, rank)"},
                        "world_size": world, "optimizer_layout": "units"}
            base = getattr(plan, "base", None) or (plan.manifest or {}).get("base")
            if base is not None:  # the pretrained source this run started from (model.init_from)
                manifest["base"] = base
            if kind_of(cfg).offers("merge"):  # which blocks' weights this run trained (looped_lm merge reads it)
                manifest["ownership"] = {"blocks": parallel.trained_blocks(cfg)}
            final = ckpt_io.finalize(out_dir, step, model, manifest, cfg.train.keep_last)
    except Exception as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailure(f"cannot write checkpoint {tmp}: {describe_os_error(e)}") from e
    dist.barrier()
    return final


def plan_last(out_dir: Path, before: int):
    """The newest complete checkpoint in out_dir below step `before` (or 'none')."""
    older = [p for p in ckpt_io.list_checkpoints(out_dir) if ckpt_io.step_of(p) < before]
    return older[-1] if older else "none"


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread of its own; its failure (a full disk) would print that thread's
    traceback, then surface again at the next `add_scalar`, where MetricsLogger names the directory and
    main() prints one line. Only that thread's traceback is dropped."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "looped_lm", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)
    hook.looped_lm = True
    threading.excepthook = hook


class MetricsLogger:
    """metrics.jsonl (truncated to the resume step, so the file is the true curve) + TensorBoard."""

    def __init__(self, out_dir: Path, rank: int, start_step: int):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        kept = []
        if self.path.exists() and start_step > 0:
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    continue
        self.path.write_text("".join(k + "\n" for k in kept))
        self.file = open(self.path, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency; tolerate its absence in minimal installs
            self.tb = None
            return
        _quiet_writer_threads()  # before the writer's thread starts: its very first write may fail (a full disk)
        try:
            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except OSError as e:
            self.file.close()
            raise OSError(e.errno, e.strerror or str(e), str(out_dir / "tb")) from None

    def log(self, step: int, values: dict) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            try:
                for k, v in values.items():
                    if isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, step)
            except OSError as e:  # the writer thread's failure (a full disk), surfaced here: name the directory
                raise OSError(e.errno, e.strerror or str(e), str(self.tb.log_dir)) from None

    def close(self, quiet: bool = False) -> None:
        """Close both logs. `quiet`: the run is failing already (its error is the one line said), so
        a failure to flush them (the same full disk) is dropped."""
        try:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
        except OSError as e:
            if not quiet:
                raise OSError(e.errno, e.strerror or str(e), e.filename or str(self.path.parent)) from None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config is not None:
        try:
            print(describe_fields(kind=args.help_config or None))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    first_rank = os.environ.get("RANK", "0") == "0"
    from looped_lm.console import plain_warnings

    plain_warnings(args.verbose)
    if not first_rank:
        warnings.simplefilter("ignore")  # every rank runs the same code: rank 0 says it once
    try:
        cfg = config_from_args(args)
        if args.no_verify and first_rank and not os.environ.get(PREFLIGHT_DONE):
            print(ckpt_io.no_verify_note(), file=sys.stderr)
        train(cfg, stop_after=args.stop_after, verify=not args.no_verify)
    except UserError as e:
        if not getattr(e, "quiet", False):
            _traceback(args.verbose)
            print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailure as e:
        if not getattr(e, "quiet", False):
            _traceback(args.verbose)
            print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # mid-run I/O (metrics, logs) outside a save
        _traceback(args.verbose)
        where = f" on {e.filename}" if e.filename else ""
        print(f"error: I/O failure{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        reason = lost_peer(e)
        if reason is None:
            raise
        _traceback(args.verbose)
        print(f"error: rank {os.environ.get('RANK', '0')} lost contact with another rank mid-run (it stopped or was "
              f"killed; its own output says why): {reason}", file=sys.stderr)
        return 1
    return 0


def lost_peer(e: RuntimeError) -> str | None:
    """The short reason of a collective that failed because another rank went away (gloo / NCCL), else None."""
    import re

    text = str(e).strip()
    if not re.search(r"gloo|NCCL|Connection (reset|closed) by peer|DistBackendError", text + type(e).__name__):
        return None
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", text.splitlines()[0])  # drop the C++ source location
    return first.split(". This is typically")[0]


def _traceback(verbose: bool) -> None:
    if verbose:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())

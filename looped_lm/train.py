"""The trainer: `looped_lm train --config X.yaml`, which runs `deepspeed --module looped_lm.train ...`;
`deepspeed looped_lm/train.py --config X.yaml [--set section.key=value ...]` works too, and so does one
process without the launcher (`python -m looped_lm.train --config X.yaml`).
Every model kind trains through the same step (training.train_step, on models/contract.py `Trainable`):
    training_loss(x, y, step, seed) -> (loss, metrics)    one micro-batch
    step_units(step, seed) -> set of unit names | None    which parameter units this step updates
    validation_loss(x, y, seed) -> loss                   held-out loss (DB models: at sigma_hi)
    checkpoint_state() / restore_state(saved)             metadata saved in the manifest (edges...)
DeepSpeed owns the optimiser, gradient accumulation, clipping and ZeRO; the model knows nothing of it.

Before anything is built, `preflight` checks what a run reads and writes: the tokenizer, the data
(tokenized once into the cache), train.out_dir, and the checkpoint a resume continues from (every file
verified; a changed seed, batch, data or tokenizer refused unless train.resume_changes: allow).
`looped_lm train` runs it before starting the launcher, so a bad run fails in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import Config, describe_fields, load_config
from looped_lm.errors import UserError

PREFLIGHT_DONE = "LOOPED_LM_PREFLIGHT_DONE"
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
    p.add_argument("--help-config", action="store_true", help="list every config field and exit")
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
# preflight: everything checkable before a process group, a model or a launcher exists


@dataclass
class Plan:
    """What preflight found: the run's vocabulary, prepared data and the checkpoint it resumes from."""

    vocab_size: int
    tokenizer: str
    data_dir: str
    resume: str | None = None
    manifest: dict | None = None
    notes: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)  # what a resume allowed to change


def data_source_string(cfg: Config) -> str:
    d = cfg.data
    return {"bible": "bible", "shakespeare": "shakespeare", "files": d.path, "hf": f"hf:{d.path}",
            "bin": d.path}[d.source]


def prepare_data(cfg: Config, vocab_size: int) -> Path:
    """Tokenize the corpus once into the cache and check both token files against the model."""
    from looped_lm.data.bin_dataset import TokenStream
    from looped_lm.data.prepare import ensure_prepared

    if cfg.data.source == "bin":
        root = Path(cfg.data.path)
        for split in ("train.bin", "val.bin"):
            if not (root / split).is_file():
                raise UserError(f"data.path {root} has no {split} (expected nanoGPT's train.bin / val.bin)")
    data_dir = Path(ensure_prepared(data_source_string(cfg), cfg.data.cache_dir, cfg.data.tokenizer,
                                    cfg.data.val_fraction, cfg.train.seed))
    for split in ("train.bin", "val.bin"):
        TokenStream(str(data_dir / split), cfg.model.seq_len, vocab_size)
    return data_dir


def preflight(cfg: Config, verify: bool = True, world_size: int | None = None) -> Plan:
    """Check the run (world_size None: the checks that depend on it wait for the launcher's count)."""
    from looped_lm.data.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(cfg.data.tokenizer)
    vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size ({vocab_size}) is smaller than the {tokenizer.name} tokenizer's "
                        f"{tokenizer.vocab_size}")
    out_dir = Path(cfg.train.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"train.out_dir {out_dir} is a file, not a directory")
    plan = Plan(vocab_size, tokenizer.name, "")
    resume = find_resume(cfg, out_dir)
    try:  # cheap checks first (the manifest against this config), the files' hashes after the data
        if resume is not None:
            plan.resume, plan.manifest = str(resume), ckpt_io.read_manifest(resume, verify)
            notes = check_resume(plan.manifest, cfg, vocab_size, world_size, resume)
            plan.notes += notes
            plan.changes = [c for n in notes if n.startswith(RESUMING_WITH)
                            for c in n.removeprefix(f"{RESUMING_WITH}: ").split("; ")]
        plan.data_dir = str(prepare_data(cfg, vocab_size))
        if resume is not None:
            ckpt_io.verify_checkpoint(resume, verify, ranks=world_size)
    except UserError as e:
        if resume is None or str(e).startswith("cannot resume"):
            raise
        raise UserError(f"cannot resume: {e}{_older_hint(out_dir, resume)}") from None
    ensure_writable(out_dir)
    plan.notes += tidy_out_dir(out_dir)
    return plan


def find_resume(cfg: Config, out_dir: Path) -> Path | None:
    """The checkpoint to continue from; never a silent fresh start over step directories it cannot use."""
    r = cfg.train.resume
    if r == "never":
        return None
    if r != "auto":
        return ckpt_io.resolve_checkpoint(r)
    steps = ckpt_io.step_dirs(out_dir)
    if not steps:
        return None
    complete = ckpt_io.list_checkpoints(out_dir)
    if not complete or steps[-1] != complete[-1]:
        older = f"; the newest complete one is {complete[-1]} (train.resume={complete[-1]})" if complete else ""
        raise UserError(f"cannot resume: {steps[-1]} has no {ckpt_io.MANIFEST} (not a complete checkpoint){older}; "
                        "delete it, or set train.resume: never to start over")
    return complete[-1]


def _older_hint(out_dir: Path, refused: Path) -> str:
    older = [p for p in ckpt_io.list_checkpoints(out_dir) if p.resolve() != Path(refused).resolve()
             and ckpt_io.step_of(p) < (ckpt_io.step_of(Path(refused)) or 0)]
    return f" (an older checkpoint: train.resume={older[-1]})" if older else ""


# settings that a resume may change without notice (inference-time or logging)
_FREE_TO_CHANGE = {"model": {"num_iterations", "bridge", "max_iterations"},
                   "diffusion": {"num_iterations", "bridge", "last_call", "sample_top_quantile"}}


def check_resume(manifest: dict, cfg: Config, vocab_size: int, world_size: int | None, path: Path) -> list[str]:
    """Refuse a checkpoint this run cannot continue exactly; return notes on allowed changes.

    The model, vocabulary and optimizer layout must match. A changed seed, global batch, grad_accum,
    data or tokenizer is refused unless train.resume_changes is allow. world_size None: the caller
    does not know it yet (checked again by the trainer)."""
    saved, mine = manifest["config"], cfg.to_dict()
    saved_world = manifest.get("world_size", 1)
    for section in ("model", "diffusion"):
        for key, value in saved.get(section, {}).items():
            if key not in _FREE_TO_CHANGE[section] and mine[section].get(key) != value:
                raise UserError(f"cannot resume from checkpoint: {section}.{key} is {value!r} there but "
                                f"{mine[section].get(key)!r} in this config")
    if manifest["vocab_size"] != vocab_size:
        raise UserError(f"cannot resume: the checkpoint's vocab_size {manifest['vocab_size']} differs from this "
                        f"run's {vocab_size}")
    for key, why in (("zero_stage", "their optimizer files differ"), ("bf16", "its optimizer keeps other state")):
        was, now = saved.get("deepspeed", {}).get(key), mine["deepspeed"][key]
        if was != now:
            raise UserError(f"cannot resume: the checkpoint was written with deepspeed.{key} {was}, this run uses "
                            f"{now} ({why})")
    if world_size is not None and mine["deepspeed"]["zero_stage"] > 0 and saved_world != world_size:
        raise UserError(f"cannot resume: the checkpoint's ZeRO optimizer state is partitioned over {saved_world} "
                        f"ranks, this run has world size {world_size}")
    st, t = saved.get("train", {}), cfg.train
    world = world_size or saved_world
    changes = []
    if st.get("seed") != t.seed:
        changes.append(f"train.seed {st.get('seed')} -> {t.seed}")
    before = st.get("batch_size", 0) * st.get("grad_accum", 0) * saved_world
    after = t.batch_size * t.grad_accum * world
    if before != after:
        changes.append(f"global batch {before} -> {after} sequences (batch_size x grad_accum x world size)")
    if st.get("grad_accum") != t.grad_accum:
        changes.append(f"train.grad_accum {st.get('grad_accum')} -> {t.grad_accum}")
    for key in ("source", "path", "tokenizer", "val_fraction"):
        was, now = saved.get("data", {}).get(key), mine["data"][key]
        if was != now:
            changes.append(f"data.{key} {was!r} -> {now!r}")
    if changes and t.resume_changes != "allow":
        raise UserError(f"cannot resume from {path}: this run changes {'; '.join(changes)}; set "
                        "train.resume_changes: allow to go on with them, or train.resume: never to start over")
    notes = [f"{RESUMING_WITH}: {'; '.join(changes)}"] if changes else []
    if world_size is not None and world_size != saved_world:
        notes.append(f"world size {saved_world} -> {world_size}: the optimizer state is whole (ZeRO 0), "
                     "ranks without a saved RNG state start theirs from the seed")
    return notes


def ensure_writable(out_dir: Path) -> None:
    probe = out_dir / f".write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"train.out_dir {out_dir} is not writable: {describe_os_error(e, out_dir)}") from None


def tidy_out_dir(out_dir: Path) -> list[str]:
    """Remove what interrupted saves left (temp dirs; step dirs without a manifest that are older than
    the newest complete checkpoint) and say so."""
    notes = []
    for tmp in sorted(out_dir.glob(".tmp-step_*")) + sorted(out_dir.glob(".old-step_*")):
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed {tmp} (left by an interrupted save)")
    newest = ckpt_io.latest_checkpoint(out_dir)
    for orphan in ckpt_io.step_dirs(out_dir):
        if newest is not None and ckpt_io.step_of(orphan) < ckpt_io.step_of(newest) \
                and not (orphan / ckpt_io.MANIFEST).is_file():
            shutil.rmtree(orphan, ignore_errors=True)
            notes.append(f"removed {orphan}: no {ckpt_io.MANIFEST} (an interrupted save or prune), and {newest} "
                         "is newer")
    return notes


def describe_os_error(e: BaseException, subject: Path | None = None) -> str:
    if isinstance(e, OSError) and e.strerror:
        other = e.filename is not None and (subject is None or Path(e.filename) != Path(subject))
        return f"{e.strerror} ({e.filename})" if other else e.strerror
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


# ---------------------------------------------------------------------------------------------
# distributed set-up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed():
    """Set up torch.distributed through DeepSpeed: NCCL on GPUs, gloo on CPU; one process works too."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # launched without the deepspeed launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import deepspeed
    import deepspeed.ops

    # init_distributed otherwise JIT-compiles a shared-memory comm op with g++ (~1 min, needs a compiler)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.deepspeed.bf16},
        "steps_per_print": 10 ** 9,  # our own logging
        "wall_clock_breakdown": False,
        # BlockwiseAdamW is torch AdamW plus per-unit skipping; ZeRO 1/2 keep its group dicts
        "zero_allow_untested_optimizer": True,
    }


class DeepSpeedRunner:
    """train_step's runner under DeepSpeed: the engine scales for accumulation, clips, reduces across
    ranks and steps the optimiser at the accumulation boundary."""

    def __init__(self, engine):
        self.engine = engine

    def loss(self, x, y, step: int):
        loss = self.engine(x, y, step)
        return loss, self.engine.module.last_metrics

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def micro_step(self) -> None:
        self.engine.step()


def refresh_curve(model, val_stream, cfg: Config, device, rank: int, step: int) -> dict | None:
    """Measure held-out CE(sigma) on rank 0 and give every rank the same curve (so every rank
    keeps the same edges and draws the same blocks)."""
    import deepspeed.comm as dist

    curve = [None]
    if rank == 0:
        was_training = model.training
        model.eval()
        x, y = val_stream.get_batch(cfg.train.batch_size, cfg.train.seed, -2, 0, 0)
        curve[0] = model.measure_curve(x.to(device), y.to(device), seed=cfg.train.seed + step)
        model.train(was_training)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(curve, src=0)
    model.apply_curve(curve[0])
    return curve[0]


# ---------------------------------------------------------------------------------------------
# the loop


def train(cfg: Config, stop_after: int = 0, verify: bool = True) -> Path | None:
    """Run training; return the final checkpoint directory (on every rank)."""
    device = init_distributed()
    import deepspeed.comm as dist

    try:
        result = _train(cfg, device, stop_after, verify)
        dist.barrier()  # before teardown: avoids a rare abort of gloo ranks at exit
        return result
    finally:
        dist.destroy_process_group()


def _train(cfg: Config, device, stop_after: int, verify: bool) -> Path | None:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from looped_lm.data.bin_dataset import TokenStream
    from looped_lm.models import build_model
    from looped_lm.optim import BlockwiseAdamW, cosine_with_warmup, param_groups
    from looped_lm.training import TrainingModule, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    t = cfg.train
    out_dir = Path(t.out_dir)
    plan = on_rank0(lambda: preflight(cfg, verify, world))
    manifest = plan.manifest
    if rank == 0 and not os.environ.get(PREFLIGHT_DONE):
        for note in plan.notes:
            print(f"note: {note}", flush=True)
    if manifest is not None and manifest["step"] >= t.max_steps:
        if rank == 0:
            print(f"nothing to train: {plan.resume} is at step {manifest['step']} and train.max_steps is "
                  f"{t.max_steps}", flush=True)
        return Path(plan.resume)
    data_dir = Path(plan.data_dir)
    train_stream = TokenStream(str(data_dir / "train.bin"), cfg.model.seq_len)
    val_stream = TokenStream(str(data_dir / "val.bin"), cfg.model.seq_len)

    torch.manual_seed(t.seed)  # identical init on every rank
    model = build_model(cfg, plan.vocab_size)  # edges from the config: a resume must agree with them
    if manifest is not None:
        try:
            with torch.device("meta"):  # the saved state must build this model (edges per block...): free
                build_model(cfg, plan.vocab_size, manifest.get("model_state", {}))
            model.restore_state(manifest.get("model_state", {}))
        except (UserError, ValueError, TypeError) as e:  # edges or curve that do not fit this model
            msg = str(e) if str(e).startswith("cannot resume") else f"cannot resume from {plan.resume}: {e}"
            raise UserError(msg) from None
    torch.manual_seed(t.seed + 1 + rank)  # noise draws (sigma, z, slots) differ across ranks

    optimizer = BlockwiseAdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                               eps=1e-8, fused=False, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, t.warmup_steps, t.max_steps, t.lr, t.min_lr) / t.lr)
    engine, _, _, _ = deepspeed.initialize(model=TrainingModule(model, t.seed), optimizer=optimizer,
                                           lr_scheduler=schedule, config=deepspeed_config(cfg, world),
                                           dist_init_required=False)
    runner = DeepSpeedRunner(engine)  # ZeRO wraps our optimiser: train_step keeps the handle on ours

    start_step, tokens_seen = 0, 0
    if manifest is not None:
        resume_from = Path(plan.resume)
        engine.load_checkpoint(str(resume_from / "optimizer"), tag="ds", load_optimizer_states=True,
                               load_lr_scheduler_states=True)
        rng_file = resume_from / "rng" / f"rank{rank}.pt"
        if rng_file.is_file():  # verified on rank 0; absent only for ranks a ZeRO-0 run added
            ckpt_io.set_rng_state(torch.load(rng_file, weights_only=False))
        start_step = manifest["step"]
        tokens_seen = manifest.get("data", {}).get("position", {}).get("tokens_seen", 0)
        if rank == 0:
            print(f"resumed from {resume_from} at step {start_step}", flush=True)

    logger = MetricsLogger(out_dir, rank, start_step) if rank == 0 else None
    if logger is not None and plan.changes:
        logger.log(start_step, {"resume_changes": plan.changes})
    tokens_per_step = t.batch_size * t.grad_accum * world * cfg.model.seq_len
    end_step = t.max_steps if stop_after <= 0 else min(t.max_steps, start_step + stop_after)
    report = Report(cfg, start_step, tokens_per_step) if rank == 0 else None
    last_ckpt = Path(plan.resume) if plan.resume else None
    t0 = time.perf_counter()
    try:
        for step in range(start_step, end_step):
            lr = schedule.get_last_lr()[0]  # this step's (engine.step advances the schedule)
            batches = (train_stream.get_batch(t.batch_size, t.seed, step, micro, rank) for micro in range(t.grad_accum))
            result = train_step(model, optimizer, runner, ((x.to(device), y.to(device)) for x, y in batches),
                                step, t.seed)
            loss_sum, metrics = result.loss, result.metrics
            done = step + 1
            tokens = tokens_seen + (done - start_step) * tokens_per_step
            if logger is not None and (done % t.log_every == 0 or done == end_step):
                elapsed = time.perf_counter() - t0
                logger.log(done, {"loss": loss_sum, "lr": lr, "tokens": tokens,
                                  "tokens_per_s": (done - start_step) * tokens_per_step / max(elapsed, 1e-9),
                                  **metrics})
            if report is not None:
                report.step(loss_sum, metrics)
            d = cfg.diffusion
            if model.uses_curve() and done % d.curve_every == 0 and \
                    (d.curve_until == 0 or done <= d.curve_until):
                curve = refresh_curve(model, val_stream, cfg, device, rank, done)
                if logger is not None:
                    logger.log(done, {"edges": model.edges, "curve_ce": curve["ce"]})
            if t.eval_every and done % t.eval_every == 0:
                val = evaluate_loss(model, val_stream, cfg, device, rank)
                if logger is not None:
                    logger.log(done, {"val_loss": val})
                    report.validation(done, val)
            if (t.save_every and done % t.save_every == 0) or done == end_step:
                last_ckpt = save(engine, model, cfg, plan, out_dir, done, tokens, rank)
                if report is not None:
                    report.line(f"step {done}: saved {last_ckpt}")
        if report is not None:
            report.summary(end_step, last_ckpt)
    finally:
        if report is not None:
            report.close()
        if logger is not None:
            logger.close()
    return last_ckpt


class SmoothedLoss:
    """Moving averages of the training loss, one per block: DiffusionBlocks steps alternate blocks whose
    losses differ by an order of magnitude, so one average (or the last value) jumps between them.
    Debiased like Adam's moments, so the first steps read right."""

    def __init__(self, beta: float = 0.9):
        self.beta, self.sums, self.counts = beta, {}, {}

    def update(self, loss: float, metrics: dict) -> None:
        key = f"b{metrics['block']}" if "block" in metrics else ""
        self.sums[key] = self.beta * self.sums.get(key, 0.0) + (1 - self.beta) * loss
        self.counts[key] = self.counts.get(key, 0) + 1

    def values(self) -> dict[str, float]:
        return {k: self.sums[k] / (1 - self.beta ** self.counts[k]) for k in sorted(self.sums)}

    def __str__(self) -> str:
        return " ".join(f"{k} {v:.4f}".strip() for k, v in self.values().items())


class Report:
    """What rank 0 prints: a progress bar with the smoothed loss per block, and plain lines for
    validation, saves and the end of the run (nanoGPT's `step N: train loss X, val loss Y`)."""

    def __init__(self, cfg: Config, start_step: int, tokens_per_step: int):
        self.cfg, self.start, self.tokens_per_step = cfg, start_step, tokens_per_step
        self.loss, self.val, self.done = SmoothedLoss(), None, start_step
        self.t0 = time.perf_counter()
        self.bar = None
        if cfg.train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def tokens_per_s(self) -> float:
        return (self.done - self.start) * self.tokens_per_step / max(time.perf_counter() - self.t0, 1e-9)

    def step(self, loss: float, metrics: dict) -> None:
        self.loss.update(loss, metrics)
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {self.loss}, {self.tokens_per_s():,.0f} tok/s", refresh=False)
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
                  f"{self.tokens_per_s():,.0f} tokens/s; train loss {self.loss}{val}; checkpoint {last_ckpt}"
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
            x, y = stream.get_batch(cfg.train.batch_size, cfg.train.seed, -1, i, rank)
            losses.append(model.validation_loss(x.to(device), y.to(device), seed=cfg.train.seed + i).item())
    model.train(was_training)
    value = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def save(engine, model, cfg: Config, plan: Plan, out_dir: Path, step: int, tokens: int, rank: int) -> Path:
    """Every rank writes its part into a temp dir; rank 0 adds the weights and manifest and renames it.
    A failed save removes its temp dir and ends the run with one line (exit 1)."""
    import deepspeed.comm as dist

    tmp = ckpt_io.tmp_dir_for(out_dir, step)
    final = out_dir / ckpt_io.step_dir_name(step)
    try:
        if rank == 0:
            if tmp.exists():  # left by a crash during an earlier save of this step
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        engine.save_checkpoint(str(tmp / "optimizer"), tag="ds")
        ckpt_io.write_rank_files(tmp, rank)
        dist.barrier()
        if rank == 0:
            manifest = {"config": cfg.to_dict(), "model_kind": cfg.model.kind, "vocab_size": plan.vocab_size,
                        "tokenizer": plan.tokenizer, "model_state": model.checkpoint_state(),
                        "data": {"dir": str(Path(plan.data_dir).resolve()),
                                 "position": {"step": step, "tokens_seen": tokens},
                                 "sampling": "stateless: batch(seed, step, micro_step, rank)"},
                        "world_size": dist.get_world_size()}
            final = ckpt_io.finalize(out_dir, step, model, manifest, cfg.train.keep_last)
    except Exception as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailure(f"cannot write checkpoint {tmp}: {describe_os_error(e)}") from e
    dist.barrier()
    return final


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

            self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        except ImportError:  # tensorboard is a dependency; tolerate its absence in minimal installs
            self.tb = None

    def log(self, step: int, values: dict) -> None:
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.help_config:
        print(describe_fields())
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
        _traceback(args.verbose)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # mid-run I/O (metrics, logs) outside a save
        _traceback(args.verbose)
        where = f" on {e.filename}" if e.filename else ""
        print(f"error: I/O failure{where}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _traceback(verbose: bool) -> None:
    if verbose:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())

"""What a run checks before a process group, a model or a launcher exists (no torch needed).

`preflight(cfg)` checks what the run reads and writes: the tokenizer, the data (tokenized once into the
cache, both token files checked against the model; a module's images or characters loaded and checked
against model.*), train.out_dir (created, writable), and the
checkpoint a resume continues from: every file verified, its model and optimizer layout the same, and
a changed seed, global batch, grad_accum, data or tokenizer refused with the list of differences unless
train.resume_changes: allow (world size, ZeRO stage and train.mode may change: the optimizer state is
stored by parameter name). It never starts over silently: step directories it cannot use are named.
Then it removes what interrupted saves left, and says so. `looped_lm train` runs it before starting the
launcher, and the trainer's rank 0 again, so a bad run fails in seconds with one line.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from looped_lm import checkpoint as ckpt_io
from looped_lm.config import Config, block_layers, init_source
from looped_lm.data.batches import data_source_string, prepare_data
from looped_lm.errors import UserError
from looped_lm.parallel import check_world

RESUMING_WITH = "resuming with changes (train.resume_changes: allow)"


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


def preflight(cfg: Config, verify: bool = True, world_size: int | None = None) -> Plan:
    """Check the run (world_size None: the checks that depend on it wait for the launcher's count)."""
    vocab_size, tokenizer = run_vocab(cfg)
    out_dir = Path(cfg.train.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"train.out_dir {out_dir} is a file, not a directory")
    if world_size is not None:
        check_world(cfg, world_size)
    plan = Plan(vocab_size, tokenizer, "")
    resume = find_resume(cfg, out_dir)
    if resume is None and init_source(cfg):  # before anything is written: the source must map
        from looped_lm.pretrained import check_source

        check_source(cfg, vocab_size)
    try:  # cheap checks first (the manifest against this config), the files' hashes after the data
        if resume is not None:
            plan.resume, plan.manifest = str(resume), ckpt_io.read_manifest(resume, verify)
            notes = check_resume(plan.manifest, cfg, vocab_size, world_size, resume)
            plan.notes += notes
            plan.changes = [c for n in notes if n.startswith(RESUMING_WITH)
                            for c in n.removeprefix(f"{RESUMING_WITH}: ").split("; ")]
        plan.data_dir = prepare_data(cfg, vocab_size)
        if resume is not None:
            ckpt_io.verify_checkpoint(resume, verify, ranks=world_size)
            ckpt_io.check_checkpoint_agrees(resume, plan.manifest)  # its fields against its own files
    except UserError as e:
        if resume is None or str(e).startswith("cannot resume"):
            raise
        raise UserError(f"cannot resume: {e}{_older_hint(out_dir, resume)}") from None
    ensure_writable(out_dir)
    plan.notes += tidy_out_dir(out_dir)
    return plan


def run_vocab(cfg: Config) -> tuple[int, str]:
    """(output vocabulary, tokenizer name) of the run (checkpoint.run_vocab: what a manifest must record)."""
    return ckpt_io.run_vocab(cfg)


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


def check_resume(manifest: dict, cfg: Config, vocab_size: int, world_size: int | None,
                 path: Path) -> list[str]:
    """Refuse a checkpoint this run cannot continue exactly; return notes on allowed changes.

    The model (layer split included), vocabulary and precision must match. A changed seed, global batch,
    grad_accum, data or tokenizer is refused unless train.resume_changes is allow. World size, ZeRO stage
    and train.mode may change: the optimizer state is stored by parameter name (checkpoints from before
    that layout: same stage, data parallel, and at ZeRO >= 1 the same world size). world_size None: the
    caller does not know it yet (checked again by the trainer)."""
    if "merged_from" in manifest:
        raise UserError(f"cannot resume from {path}: it is a merge of block jobs (`looped_lm merge`): weights only, "
                        "no optimizer state")
    saved, mine = manifest["config"], cfg.to_dict()
    saved_world = manifest.get("world_size", 1)
    layout = ckpt_io.optimizer_layout(manifest)
    for section in ("model", "diffusion"):
        for key, value in saved.get(section, {}).items():
            if key not in _FREE_TO_CHANGE[section] and mine[section].get(key) != value:
                raise UserError(f"cannot resume from checkpoint: {section}.{key} is {value!r} there but "
                                f"{mine[section].get(key)!r} in this config")
    split = block_layers(ckpt_io.config_of(manifest, path))
    if split != block_layers(cfg):
        raise UserError(f"cannot resume from checkpoint: its blocks have {split} layers, this config "
                        f"{block_layers(cfg)} (diffusion.layers_per_block)")
    if manifest["vocab_size"] != vocab_size:
        raise UserError(f"cannot resume: the checkpoint's vocab_size {manifest['vocab_size']} differs from this "
                        f"run's {vocab_size}")
    # optimizer state by parameter name (layout units) resumes at any ZeRO stage and world size; DeepSpeed's
    # own files (older checkpoints) only at their own stage, and at ZeRO >= 1 their own world size
    for key, why in (("zero_stage", "their optimizer files differ"), ("bf16", "its optimizer keeps other state")):
        was, now = saved.get("deepspeed", {}).get(key), mine["deepspeed"][key]
        if was != now and (key == "bf16" or layout == "deepspeed"):
            raise UserError(f"cannot resume: the checkpoint was written with deepspeed.{key} {was}, this run uses "
                            f"{now} ({why})")
    if layout == "deepspeed" and mine["train"]["mode"] != "data_parallel":
        raise UserError(f"cannot resume {path} in train.mode {mine['train']['mode']}: it holds DeepSpeed's own "
                        "optimizer files, which only resume in data_parallel mode at the same ZeRO stage")
    if world_size is not None and layout == "deepspeed" and mine["deepspeed"]["zero_stage"] > 0 \
            and saved_world != world_size:
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
    switched = []
    if world_size is not None and world_size != saved_world:
        switched.append(f"world size {saved_world} -> {world_size}")
    for key in ("zero_stage",):
        if saved.get("deepspeed", {}).get(key) != mine["deepspeed"][key]:
            switched.append(f"deepspeed.{key} {saved.get('deepspeed', {}).get(key)} -> {mine['deepspeed'][key]}")
    if st.get("mode", "data_parallel") != t.mode:
        switched.append(f"train.mode {st.get('mode', 'data_parallel')} -> {t.mode}")
    if switched:
        whole = "re-sharded by parameter name" if layout == "units" else "whole (ZeRO 0)"
        notes.append(f"{', '.join(switched)}: the optimizer state is {whole}; ranks without a saved RNG state "
                     "start theirs from the seed")
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


def nothing_to_train(plan: Plan, cfg: Config) -> str | None:
    """The line to print when the checkpoint resumed is already at train.max_steps (or past it)."""
    if plan.manifest is None or plan.manifest["step"] < cfg.train.max_steps:
        return None
    return (f"nothing to train: {plan.resume} is at step {plan.manifest['step']} and train.max_steps is "
            f"{cfg.train.max_steps}")

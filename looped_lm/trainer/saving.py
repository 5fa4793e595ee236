"""Checkpoints of a run: every rank writes its part (RNG state, the optimizer units it writes), rank 0 the weights
and the manifest, into a temp directory renamed at the end."""

from __future__ import annotations

import shutil
from pathlib import Path

import deepspeed.comm as dist

from looped_lm import checkpoint as ckpt_io
from looped_lm import tensor_files
from looped_lm import parallel
from looped_lm.config import Config, init_source
from looped_lm.errors import RunFailure
from looped_lm.manifest import OPTIMIZER_BY_UNIT, STATELESS_SAMPLING, Manifest
from looped_lm.optim import state_by_name
from looped_lm.preflight import Plan, describe_os_error
from looped_lm.trainer.distributed import bf16_autocast


def run_manifest(cfg: Config, plan: Plan, model, step: int, tokens: int, world: int,
                 conversion: bool = False) -> Manifest:
    """The manifest of a run's checkpoint at `step` (checkpoint.finalize adds the files' sizes and hashes): what
    every verb reads back. `conversion`: train.max_steps 0, the model as built, weights only."""
    data = {"dir": plan.data_dir, "position": {"step": step, "tokens_seen": tokens}}
    if not conversion:
        data["sampling"] = STATELESS_SAMPLING
    # the pretrained source this run started from (model.init_from), as found now or at the run's start
    base = getattr(plan, "base", None) or (plan.manifest.base if plan.manifest is not None else None)
    return Manifest.of(cfg, vocab_size=plan.vocab_size, tokenizer=plan.tokenizer, model_state=model.checkpoint_state(),
                       data=data, world_size=world, step=step, optimizer_layout=OPTIMIZER_BY_UNIT,
                       conversion={"init_from": init_source(cfg) or None} if conversion else None, base=base)


def save(engine, model, optimizer, cfg: Config, plan: Plan, out_dir: Path, step: int, tokens: int, rank: int) -> Path:
    """Every rank writes its part into a temp dir (its RNG state, the optimiser units it is the writer of);
    rank 0 adds the weights and manifest and renames it. A failed save removes its temp dir and ends the
    run with one line (exit 1); a killed one leaves the temp dir, which the next start removes."""


    tmp = ckpt_io.tmp_dir_for(out_dir, step)
    final = out_dir / ckpt_io.step_dir_name(step)
    world = dist.get_world_size()
    # a finite loss and gradient can still leave non-finite weights (an update too large): never save them.
    # Every rank holds the same weights here, so every rank stops together, before anything is written.
    bad = tensor_files.nonfinite_tensor(model.state_dict().items())
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
        tensor_files.write_rank_files(tmp, rank)
        dist.barrier()
        if rank == 0:
            final = ckpt_io.finalize(out_dir, step, model, run_manifest(cfg, plan, model, step, tokens, world),
                                     cfg.train.keep_last)
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

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

The package, in the order a run meets it:
    args.py         the flags and the run config they make (light: `looped_lm train --help` imports no torch)
    distributed.py  DeepSpeed: joining the ranks, the engine's config, train_step's runner over the engine
    run.py          one run, phase by phase (check, build, engine, resume, outputs), then the loop
    report.py       what rank 0 reports: smoothed losses, progress, MFU, metrics.jsonl and TensorBoard
    saving.py       checkpoints and their manifest
    command.py      the command: flags -> config -> run; one line and an exit code for what goes wrong

Before anything is built, `preflight.preflight` checks what the run reads and writes (rank 0; and
`looped_lm train` before it starts the launcher).
"""

from __future__ import annotations

import importlib

# name -> the module that defines it; loaded when first asked for (torch and DeepSpeed cost seconds, and
# `looped_lm train --help` needs only args.py)
_WHERE = {
    "PREFLIGHT_DONE": "args", "RENDEZVOUS_FILE": "args", "add_arguments": "args", "config_from_args": "args",
    "forward_args": "args", "parse_args": "args",
    "free_port": "args", "init_distributed": "distributed", "deepspeed_config": "distributed",
    "bf16_autocast": "distributed", "DeepSpeedRunner": "distributed", "lost_peer": "distributed",
    "train": "run", "refresh_curve": "run", "evaluate_loss": "run", "on_device": "run",
    "FlopsMeter": "report", "MetricsLogger": "report", "Report": "report", "SmoothedLoss": "report",
    "run_manifest": "saving", "save": "saving",
    "main": "command",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)

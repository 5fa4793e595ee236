"""`looped_lm train --config X.yaml --dry-run [--nproc N] [--device-type cuda]`: what the run would be, worked out
here without training or touching its data.

The config is loaded and checked (the kind's checks, the world size), the model is built on torch's meta device
(nothing allocated: a paper-scale model on a laptop), its parameters, one optimizer step's FLOPs (the kind's cost
model) and the bytes its weights, gradients and AdamW state need per rank are counted, the decisions the trainer
takes on the target device are printed (looped_lm/devices.py: dist backend, matmul precision, compile, AdamW
kernel, DeepSpeed's bf16 mode), and so is the launcher command it would run on N processes (looped_lm/launch.py builds it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from looped_lm import devices
from looped_lm.trainer.distributed import deepspeed_config
from looped_lm.data.tokenizer import run_vocab
from looped_lm.config import Config, init_source
from looped_lm.kinds import kind_of
from looped_lm.mfu import StepFlops
from looped_lm.models import build_model
from looped_lm.parallel import check_world
from looped_lm.preflight import FROZEN_BYTES  # a frozen parameter (LoRA's base) holds only its fp32 weight



def _gib(n: float) -> str:
    return f"{n / 2 ** 30:,.2f} GiB"


def _count(cfg: Config, vocab_size: int) -> tuple[int, int]:
    """(trained, frozen) parameters of the model `cfg` builds, on the meta device."""
    with torch.device("meta"):
        model = build_model(cfg, vocab_size)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters()) - trained


def state_bytes(cfg: Config, trained: int, frozen: int, world: int, bf16_weights: bool) -> int:
    """Bytes per rank of the weights, gradients and AdamW state, with ZeRO's partitioning over the ranks (stage
    1: the optimizer state and fp32 master weights, stage 2: the gradients too); activations not included.
    fp32 weights (also under bf16 autocast): 4 + 4 + 8 per parameter; DeepSpeed's bf16 weights: 2 + 2, and at
    ZeRO 0 bf16 moments (4), at ZeRO 1/2 fp32 master weights and moments (12)."""
    stage = cfg.deepspeed.zero_stage
    share = 1 / world if stage >= 1 else 1.0
    if not bf16_weights:
        weight, grad, optimizer = 4, 4, 8
    elif stage == 0:
        weight, grad, optimizer = 2, 2, 4
    else:
        weight, grad, optimizer = 2, 2, 12
    per_trained = weight + grad * (1 / world if stage >= 2 else 1) + optimizer * share
    return int(trained * per_trained + frozen * FROZEN_BYTES)


def report(cfg: Config, config_name: str, launcher_cmd: list[str], nproc: int, device_type: str = "cuda") -> list[str]:
    """The dry run's lines (raises UserError where the run would be refused)."""
    kind = kind_of(cfg)
    check_world(cfg, nproc)
    vocab_size, tokenizer = run_vocab(cfg)
    trained, frozen = _count(cfg, vocab_size)
    t = cfg.train
    flops = StepFlops(cfg, vocab_size)
    step = flops()
    ds = deepspeed_config(cfg, nproc)
    bf16 = "off" if not cfg.deepspeed.bf16 else ("autocast over fp32 weights" if ds["torch_autocast"]["enabled"]
                                                  else "DeepSpeed's bf16 weights")
    data = Path(cfg.data.path) if cfg.data.path else None
    seq_len = getattr(cfg.model, "seq_len", None)
    batch = f"{t.batch_size} sequences of {seq_len} tokens" if seq_len else f"{t.batch_size} samples"
    bf16_weights = ds["bf16"]["enabled"]
    lines = [
        f"dry run of {config_name}: model.kind {kind.name}, on {nproc} {device_type} process(es); nothing is trained",
        f"  model: {trained + frozen:,} parameters ({trained:,} trained{f', {frozen:,} frozen' if frozen else ''})"
        + (f", vocabulary {vocab_size:,} ({tokenizer})" if seq_len else "") + ", built on the meta device",
        f"  step: {batch} x {t.grad_accum} micro-batch(es) per rank; "
        + (f"{step / 1e12:,.3f} TFLOP per optimizer step per rank (forward + backward, the cost model)"
           if step is not None else "no cost model for this kind"),
        f"  memory: {_gib(state_bytes(cfg, trained, frozen, nproc, bf16_weights))} per rank for weights, gradients and AdamW "
        f"state (ZeRO {cfg.deepspeed.zero_stage}, bf16 {bf16}), before activations",
        f"  on {device_type}: dist backend {devices.dist_backend(device_type)}, fp32 matmul precision "
        f"{devices.fp32_matmul_precision(device_type, cfg.deepspeed.bf16)}, compile "
        f"{'on' if devices.compile_enabled(t.compile, device_type) else 'off'} (train.compile {t.compile}), AdamW "
        f"{devices.adamw_implementation(device_type)}",
        f"  data: {cfg.data.source}" + (f" at {data} ({'here' if data.exists() else 'not on this machine'})"
                                         if data else " (embedded or prepared at launch)"),
    ]
    if init_source(cfg):
        lines.append(f"  from: {init_source(cfg)} (model.init_from, converted at launch)")
    lines.append("  launch: " + shlex.join(["deepspeed", *launcher_cmd[1:]]))
    return lines

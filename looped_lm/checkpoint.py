"""Checkpoints: `model.safetensors` + `optimizer/` (DeepSpeed's files) + `rng/` + `manifest.json`.

Layout of one checkpoint, `out_dir/step_000500/`:
    model.safetensors   full model weights (what eval, generate, serve and export read)
    optimizer/          DeepSpeed engine state (optimizer moments, LR schedule), for resume only
    rng/rank{r}.pt      torch / numpy / python RNG states of each rank
    manifest.json       config, tokenizer, step, data position, model metadata (edges...), sha256 of
                        model.safetensors, code version; written LAST

Every rank writes into `out_dir/.tmp-step_000500/`, then rank 0 renames it. A directory without a
manifest, or whose weights do not match the manifest's hash, is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from looped_lm import __version__
from looped_lm.config import Config, config_from_dict
from looped_lm.errors import UserError

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def state_dict_for_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies; tied weights are stored once (safetensors refuses shared storage)."""
    out, seen = {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.stride())
        if key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    return out


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def tmp_dir_for(out_dir: Path, step: int) -> Path:
    return out_dir / f".tmp-{step_dir_name(step)}"


def write_rank_files(tmp: Path, rank: int) -> None:
    """Per-rank part of a save (all ranks, before the barrier)."""
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank{rank}.pt")


def finalize(out_dir: Path, step: int, model: torch.nn.Module, manifest: dict, keep_last: int) -> Path:
    """Rank 0, after every rank has written its part: weights, manifest, atomic rename, pruning."""
    tmp = tmp_dir_for(out_dir, step)
    save_file(state_dict_for_save(model), str(tmp / WEIGHTS), metadata={"format": "looped_lm"})
    manifest = {**manifest, "step": step, "format_version": FORMAT_VERSION, "looped_lm_version": __version__,
                "weights_sha256": sha256_file(tmp / WEIGHTS)}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    final = out_dir / step_dir_name(step)
    if final.exists():  # an older save of the same step (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints (a manifest is present), oldest first."""
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.glob("step_*") if p.is_dir() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(out_dir: Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def read_manifest(ckpt: str | Path) -> dict:
    ckpt = Path(ckpt)
    if not ckpt.exists():
        raise UserError(f"checkpoint directory not found: {ckpt}")
    if not ckpt.is_dir():
        raise UserError(f"checkpoint path is not a directory: {ckpt}")
    if not (ckpt / MANIFEST).is_file():
        raise UserError(f"{ckpt} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{ckpt / MANIFEST} is corrupted: {e}") from None
    for key in ("config", "step", "weights_sha256", "vocab_size", "tokenizer"):
        if key not in manifest:
            raise UserError(f"{ckpt / MANIFEST} is incomplete: no '{key}'")
    return manifest


def verify_weights(ckpt: Path, manifest: dict) -> None:
    weights = ckpt / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{ckpt} is incomplete: {WEIGHTS} is missing")
    if sha256_file(weights) != manifest["weights_sha256"]:
        raise UserError(f"{weights} does not match the hash in its manifest: the checkpoint is truncated "
                        "or corrupted; refusing to load it")


def load_checkpoint(ckpt: str | Path, device: str | torch.device = "cpu"):
    """Verified (model, config, manifest) from a checkpoint directory, in eval mode."""
    from looped_lm.models import build_model

    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    verify_weights(ckpt, manifest)
    cfg = config_from_dict(manifest["config"])
    model = build_model(cfg, manifest["vocab_size"], manifest.get("model_state"))
    try:
        state = load_file(str(ckpt / WEIGHTS), device=str(device))
    except SafetensorError as e:
        raise UserError(f"cannot read {ckpt / WEIGHTS}: {e}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _is_tied_alias(model, k)]
    if missing or unexpected:
        raise UserError(f"{ckpt / WEIGHTS} does not fit the model in its manifest "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device).eval(), cfg, manifest


def _is_tied_alias(model: torch.nn.Module, key: str) -> bool:
    """A key dropped at save time because it shares storage with another saved key."""
    sd = model.state_dict()
    ptr = sd[key].data_ptr()
    return any(k != key and v.data_ptr() == ptr for k, v in sd.items())


def config_of(manifest: dict) -> Config:
    return config_from_dict(manifest["config"])

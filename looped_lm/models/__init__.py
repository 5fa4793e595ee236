"""Model registry: `model.kind` -> a constructor taking (config, vocab_size, saved model state).

Entries name their module and function as a string and are imported on first use, so the registry
imports no model and no model imports the registry (vLLM's lazy-registry pattern).
"""

from __future__ import annotations

import importlib

from looped_lm.config import Config
from looped_lm.errors import UserError

BUILDERS = {
    "gpt": "looped_lm.models.gpt:build",
    "db_ar": "looped_lm.models.db:build",
    "looped_db": "looped_lm.models.db:build",  # one block (the weight-tied core), prelude and coda around it
    "huginn": "looped_lm.models.huginn:build",
    # the supporting modules (method.md §7): not language models, trained by the same trainer
    "vit": "looped_lm.models.vit:build",
    "dit": "looped_lm.models.dit:build",
    "mdm": "looped_lm.models.mdm:build",
}


def register(kind: str, target: str) -> None:
    """Add a kind: `target` is "package.module:function" (called with (cfg, vocab_size, state))."""
    BUILDERS[kind] = target


def build_model(cfg: Config, vocab_size: int, state: dict | None = None):
    """Build `cfg.model.kind`. `state` is the model metadata a checkpoint saved (e.g. block edges)."""
    target = BUILDERS.get(cfg.model.kind)
    if target is None:
        raise UserError(f"model.kind '{cfg.model.kind}' is not available (have: {', '.join(sorted(BUILDERS))})")
    module, _, name = target.partition(":")
    model = getattr(importlib.import_module(module), name)(cfg, vocab_size, state)
    if cfg.train.lora_rank:  # adapters on a frozen base: the same names wherever a model is built
        from looped_lm.lora import attach

        attach(model, cfg)
    return model

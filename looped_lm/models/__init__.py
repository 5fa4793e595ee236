"""Model registry: `model.kind` -> a constructor taking (config, vocab_size, saved model state)."""

from __future__ import annotations

from looped_lm.config import Config
from looped_lm.errors import UserError


def _build_gpt(cfg: Config, vocab_size: int, state: dict | None):
    from looped_lm.models.gpt import GPT

    m = cfg.model
    return GPT(m.n_layers, m.d_model, m.n_heads, m.seq_len, vocab_size, m.ffn_hidden, m.rope_theta,
               m.norm_eps, m.init_std, loss_chunk=m.loss_chunk)


BUILDERS = {"gpt": _build_gpt}


def register(kind: str, builder) -> None:
    BUILDERS[kind] = builder


def build_model(cfg: Config, vocab_size: int, state: dict | None = None):
    """Build `cfg.model.kind`. `state` is the model metadata a checkpoint saved (e.g. block edges)."""
    _import_all()
    builder = BUILDERS.get(cfg.model.kind)
    if builder is None:
        raise UserError(f"model.kind '{cfg.model.kind}' is not available (have: {', '.join(sorted(BUILDERS))})")
    return builder(cfg, vocab_size, state)


def _import_all() -> None:
    """Model modules register themselves on import; import the optional ones lazily here."""
    import importlib

    for name in ("looped_lm.models.db", "looped_lm.models.huginn"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise

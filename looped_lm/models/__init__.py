"""Build the network of a run: `model.kind`'s plugin (looped_lm/kinds) names its builder, imported on
first use, so nothing here imports a model until one is built (vLLM's lazy-registry pattern)."""

from __future__ import annotations

from looped_lm.config import Config
from looped_lm.kinds import kind_of


def build_model(cfg: Config, vocab_size: int, state: dict | None = None):
    """Build `cfg.model.kind`. `state` is the model metadata a checkpoint saved (e.g. block edges)."""
    model = kind_of(cfg).build(cfg, vocab_size, state)
    layer_types = getattr(cfg.model, "layer_types", None)
    if layer_types:  # Gemma 3's local layers, placed by the kind's layer plan as a source's layers are
        from looped_lm.models.layers import mark_local_layers

        plan = kind_of(cfg).source_layers(cfg, len(layer_types))
        mark_local_layers(model, plan, layer_types, cfg.model.sliding_window)
    if cfg.train.lora_rank:  # adapters on a frozen base: the same names wherever a model is built
        from looped_lm.lora import attach

        attach(model, cfg)
    return model

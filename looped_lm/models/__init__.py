"""Build the network of a run: its kind builds the network's frozen args once from the run config
(looped_lm/models/args.py, the one module here that reads it), and the kind's builder, named by the
plugin and imported on first use, builds the network from them (vLLM's lazy-registry pattern)."""

from __future__ import annotations

from looped_lm.lora import attach
from looped_lm.models.args import build_network, lora_rank, network_args

__all__ = ["build_model", "build_network", "network_args"]


def build_model(cfg, vocab_size: int, state: dict | None = None):
    """Build `cfg.model.kind`. `state` is the model metadata a checkpoint saved (e.g. block edges)."""
    model = build_network(network_args(cfg, vocab_size), state)
    if lora_rank(cfg):  # adapters on a frozen base: the same names wherever a model is built
        attach(model, cfg)
    return model

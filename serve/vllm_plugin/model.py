"""The exported looped_lm models inside vLLM: the native module's weights and layers, vLLM's paged attention.

One definition: `self.model` is the native module (built by `build_network` from the args of the exported
config); its projections, norms, RoPE tables and SwiGLU are called as they are. Only the attention core is vLLM's
`Attention` (one per layer, one KV slot each), which owns the paged KV cache, continuous batching and
prefix caching. Tokens are flattened: x is (N, C) for the N scheduled tokens.
  gpt                 here
  db_ar, looped_db    `db_model.DiffusionBlocksRunner`: K (and the bridge) fixed per server, from the
                      exported config or `hf_overrides={"num_iterations": K}`; models trained with
                      `diffusion.noisy_self: false`
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn as nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from looped_lm.kinds import get_kind
from looped_lm.models import build_network
from looped_lm.models.args import args_from_dict
from looped_lm.sampling import PLAIN
from looped_lm.settings import iterations_note, resolve_settings
from looped_lm.serve.vllm_plugin.attention import paged_attention
from looped_lm.serve.vllm_plugin.db_model import DiffusionBlocksRunner

UNSUPPORTED = ("model.kind '{kind}' is not served by the vLLM plugin (its cache holds one KV set per "
               "(iteration, layer)); serve it with `looped_lm serve`")
GEMMA_UNSUPPORTED = ("the vLLM plugin runs Llama's layers; this model has Gemma 3's ({fields}: sandwich norms, local "
                     "sliding-window layers, a scaled embedding); serve it with `looped_lm serve`")


def gemma_options(args) -> list[str]:
    """The Gemma 3 layer options a model's args (`LMArgs`) set, which the plugin's paged attention and layer
    loop do not apply."""
    return [f"model.{name}" for name, value in (
        ("sandwich_norm", args.layer.sandwich_norm), ("mlp_activation", args.layer.activation != "silu"),
        ("embed_scale", args.embed_scale != 1.0), ("attn_scalar", args.layer.attention.scalar),
        ("layer_types", args.local_layers)) if value]


class LoopedLMForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if not get_kind(config.kind).offers("vllm"):
            raise ValueError(UNSUPPORTED.format(kind=config.kind))
        self.config = config
        args = args_from_dict(config.looped_lm_config, config.vocab_size)  # the native network's frozen args
        if gemma_options(args):
            raise ValueError(GEMMA_UNSUPPORTED.format(fields=", ".join(gemma_options(args))))
        self.model = build_network(args, config.model_state or None)
        self.db = None
        if get_kind(config.kind).offers("iterative"):
            limits = self.model.iteration_limits()
            settings = resolve_settings(limits, num_iterations=config.num_iterations, bridge=config.bridge,
                                        sampling=PLAIN)
            note = iterations_note(limits, settings)
            if note:  # K < B, or above the usual chain: the line generate and the server give
                logging.getLogger(__name__).warning(note)
            self.db = DiffusionBlocksRunner(self.model, settings, int(getattr(config, "decode_seed", 0) or 0),
                                            vllm_config.cache_config, f"{prefix}.db")
            return
        first = self.model.layers[0].attn
        self.n_heads, self.head_dim = first.n_heads, first.head_dim
        self.attn = nn.ModuleList(
            Attention(self.n_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.n_heads,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn.{i}")
            for i in range(len(self.model.layers)))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_emb(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        if self.db is not None:
            return self.db(input_ids, positions)
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.model.rope(positions)
        for layer, attn in zip(self.model.layers, self.attn):
            h = h + paged_attention(layer, attn, layer.norm1(h), cos, sin)[0]
            h = h + layer.mlp(layer.norm2(h))
        return h  # (N, C), before the final norm

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.db is not None:
            return self.db.compute_logits(hidden_states)
        return self.model.logits(hidden_states)  # final norm, then the tied head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            key = name.removeprefix("model.")
            if key not in params:
                raise ValueError(f"unexpected weight {name} in the exported checkpoint")
            with torch.no_grad():
                params[key].copy_(tensor.to(params[key].dtype))
            loaded.add(f"model.{key}")
        missing = {f"model.{k}" for k in params} - loaded
        if missing:
            raise ValueError(f"weights missing from the exported checkpoint: {sorted(missing)[:3]}")
        return loaded

"""The exported DiffusionBlocks LMs (db_ar, looped_db) inside vLLM: K routed denoising steps per token.

One definition: `model` is the native `DiffusionBlocksLM`; its clean encoder layers, noisy step, likelihood
term and targets are called as they are, and the K-step chain is `looped_lm.diffusion.chain.run_chain`,
the same function `generate`, the engine and eval use. vLLM's `Attention` (one per clean-stream layer: the
prelude's, and every block's layers + coda) owns the paged KV cache of the CLEAN stream, which does not
depend on sigma or K. Each forward:

  1. runs the clean stream of every block for the scheduled tokens (their K/V enter vLLM's cache), then
  2. runs the chain for every scheduled token at once (one row per token); at each step the routed
     block's noisy queries (RoPE position p+1) go through the SAME `Attention` again with the same clean
     K/V: vLLM rewrites identical values and returns each noisy query's causal attention over the
     sequence's clean keys 0..p. That is the whole noisy attention of a model trained with
     `noisy_self: false` (a model whose slots also attend their own key cannot be served this way).

Noise: vLLM's forward sees positions, not requests, so every draw of the token after position p (its
starting z, the bridge's tokens) comes from `PositionalRandom(seed, positions)`: the same for any
batching, and reproducible natively by passing the same random source to `forward_cached`.
`forward` returns the chain's last logits; `compute_logits` hands them on.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.model_executor.layers.attention import Attention

from looped_lm.diffusion.chain import run_chain
from looped_lm.models.two_stream import modulate
from looped_lm.sampling import PositionalRandom
from looped_lm.serve.vllm_plugin.attention import paged_attention
from looped_lm.settings import InferenceSettings


class DiffusionBlocksRunner(nn.Module):
    """The vLLM forward of a DiffusionBlocksLM `model` at fixed settings (K, bridge, greedy bridge draws
    drawn with the settings. sampler)."""

    def __init__(self, model, settings: InferenceSettings, seed: int, cache_config, prefix: str):
        super().__init__()
        if model.noisy_self:
            raise ValueError("this DiffusionBlocks model was trained with diffusion.noisy_self: true: its noisy "
                             "slots attend their own key besides the cached clean keys, which vLLM's paged "
                             "attention cannot express; serve it with `looped_lm serve`, or train with "
                             "noisy_self: false (docs/export.md)")
        self.model, self.settings, self.seed = model, settings, seed
        first = model.blocks[0][0].attn
        self.n_heads, self.head_dim = first.n_heads, first.head_dim

        def attention(name):
            return Attention(self.n_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.n_heads,
                             cache_config=cache_config, prefix=f"{prefix}.{name}")

        self.prelude_attn = nn.ModuleList(attention(f"prelude.{i}") for i in range(len(model.prelude)))
        self.block_attn = nn.ModuleList(
            nn.ModuleList(attention(f"block{b}.{i}") for i in range(len(model.layers_of(b))))
            for b in range(len(model.blocks)))

    def _clean_layer(self, layer, attn, x, cos, sin, need_output: bool = True):
        """One causal layer over the flattened tokens x (N, C), through vLLM's cache -> (x, k, v)."""
        out, k, v = paged_attention(layer, attn, layer.norm1(x), cos, sin)
        if not need_output:
            return None, k, v
        x = x + out
        return x + layer.mlp(layer.norm2(x)), k, v

    def _noisy_layer(self, layer, attn, h, cond, cos, sin, k, v):
        """The noisy slots h (1, N, C) through one layer: their queries attend the clean keys 0..p."""
        N, C = h.shape[1], h.shape[2]
        shift1, scale1, gate1, shift2, scale2, gate2 = layer.ada(cond).unsqueeze(1).chunk(6, dim=-1)
        q = layer.attn.project_query(modulate(layer.norm1(h), shift1, scale1), cos, sin)  # (1, H, N, D)
        y = attn(q[0].transpose(0, 1).reshape(N, C), k, v)  # rewrites the same clean K/V, then attends
        h = h + gate1 * layer.attn.proj(y.view(1, N, C))
        return h + gate2 * layer.mlp(modulate(layer.norm2(h), shift2, scale2))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N,) tokens at (N,) positions -> (N, V): the logits of the token after each position."""
        m = self.model
        N = input_ids.shape[0]
        cos, sin = m.rope(positions)
        x = m.tok_emb(input_ids)
        for layer, attn in zip(m.prelude, self.prelude_attn):
            x, _, _ = self._clean_layer(layer, attn, x, cos, sin)
        clean_kv, inputs, carry = [None] * len(m.blocks), [None] * len(m.blocks), x
        for b in (m.stack_order if m.stacked else range(len(m.blocks))):
            c, kv, layers, own = carry if m.feeder(b) is not None else x, [], m.layers_of(b), len(m.blocks[b])
            inputs[b] = c  # block b's clean input state at each token: noisy_input clean_state's slot input
            hand_on = m.fed(b) is not None  # context stacked: the next block of stack_order continues from here
            for i, (layer, attn) in enumerate(zip(layers, self.block_attn[b])):
                c, k, v = self._clean_layer(layer, attn, c, cos, sin,
                                            need_output=i + 1 < len(layers) or (hand_on and i + 1 == own))
                kv.append((k, v))
                if hand_on and i + 1 == own:
                    carry = c
            clean_kv[b] = kv
        cos_n, sin_n = m.rope(positions + 1)  # the noisy slot of the token after position p

        def denoise(b, z, sigma, rows):  # every row (token) runs the same step: rows is all of them
            h, cond, loglik = m.noisy_input(z.view(1, N, -1), sigma[:1], input_ids[None],
                                            inputs[b][None] if m.clean_state else None)
            for layer, attn, (k, v) in zip(m.layers_of(b), self.block_attn[b], clean_kv[b]):
                h = self._noisy_layer(layer, attn, h, cond, cos_n, sin_n, k, v)
            return m.denoise_logits(h, z.view(1, N, -1), sigma[:1], loglik).view(N, 1, -1)

        random = PositionalRandom(self.seed, positions)
        z = m.initial_noise(N, 1, random, x.device)
        result = run_chain(denoise, m.grid(), [self.settings] * N, z, random, m.targets, m.target_table)
        return result.logits[:, 0].float()

    def compute_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

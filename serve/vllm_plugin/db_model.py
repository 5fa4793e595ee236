"""The exported DiffusionBlocks LMs (db_ar, looped_db) inside vLLM: K routed denoising steps per token.

One definition: `model` is the native `DiffusionBlocksLM`; its projections, norms, adaLN, noise embedding,
likelihood term, bridge and Euler step are called as they are. vLLM's `Attention` (one per clean-stream
layer: the prelude's, and every block's layers + coda) owns the paged KV cache of the CLEAN stream, which
does not depend on sigma or K. Each forward:

  1. runs the clean stream of every block for the scheduled tokens (their K/V enter vLLM's cache), then
  2. runs the K-step chain for every scheduled token in parallel; at step k the routed block's noisy
     queries (RoPE position p+1) go through the SAME `Attention` again with the same clean K/V: vLLM
     rewrites identical values and returns each noisy query's causal attention over the sequence's
     clean keys 0..p. That is the whole noisy attention of a model trained with `noisy_self: false`
     (a model whose slots also attend their own key cannot be served this way: refused at load).

Noise: vLLM's forward sees positions, not requests, so the starting z of the token after position p
is drawn from a generator seeded by (decode_seed, p), and the `sample` bridge's draws by (decode_seed,
p, step): the same for any batching. `positional_noise` gives the native engine the same z.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from vllm.model_executor.layers.attention import Attention

from looped_lm import diffusion as dm
from looped_lm.models.db_decode import positional_gumbel, positional_noise
from looped_lm.models.two_stream import modulate
from looped_lm.serve.vllm_plugin.attention import paged_attention

class DiffusionBlocksRunner(nn.Module):
    """The vLLM forward of a DiffusionBlocksLM `model` at a fixed K and bridge."""

    def __init__(self, model, num_iterations: int, bridge: str, seed: int, cache_config, prefix: str):
        super().__init__()
        if model.noisy_self:
            raise ValueError("this DiffusionBlocks model was trained with diffusion.noisy_self: true: its noisy "
                             "slots attend their own key besides the cached clean keys, which vLLM's paged "
                             "attention cannot express; serve it with `looped_lm serve`, or train with "
                             "noisy_self: false (docs/export.md)")
        self.model, self.K, self.bridge, self.seed = model, num_iterations, bridge, seed
        first = model.blocks[0][0].attn
        self.n_heads, self.head_dim = first.n_heads, first.head_dim

        def attention(name):
            return Attention(self.n_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.n_heads,
                             cache_config=cache_config, prefix=f"{prefix}.{name}")

        self.prelude_attn = nn.ModuleList(attention(f"prelude.{i}") for i in range(len(model.prelude)))
        self.block_attn = nn.ModuleList(
            nn.ModuleList(attention(f"block{b}.{i}") for i in range(len(model.layers_of(b))))
            for b in range(len(model.blocks)))
        sigmas = model.chain_sigmas(num_iterations)
        self.sigmas = sigmas
        self.route = [dm.route_sigma(s, model.edges) for s in sigmas[:-1]]

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
        """(N,) tokens at (N,) positions -> (N, 2C + 1): the last step's noisy state, z and sigma, which
        `compute_logits` turns into the next tokens' logits."""
        m = self.model
        N = input_ids.shape[0]
        cos, sin = m.rope(positions)
        x = m.tok_emb(input_ids)
        for layer, attn in zip(m.prelude, self.prelude_attn):
            x, _, _ = self._clean_layer(layer, attn, x, cos, sin)
        clean_kv, block_in = [], x
        for b in range(len(m.blocks)):
            c, kv = (block_in if m.stacked else x), []
            layers = m.layers_of(b)
            for i, (layer, attn) in enumerate(zip(layers, self.block_attn[b])):
                need = m.stacked or i + 1 < len(layers)
                c, k, v = self._clean_layer(layer, attn, c, cos, sin, need_output=need)
                kv.append((k, v))
            clean_kv.append(kv)
            block_in = c
        cos_n, sin_n = m.rope(positions + 1)  # the noisy slot of the token after position p
        C = x.shape[1]
        z = positional_noise(self.seed, positions, C, m.sigma_top()).to(x.device, torch.float32)[None]
        prev = input_ids[None]
        for k_step, b in enumerate(self.route):
            sigma = torch.full((1,), self.sigmas[k_step], device=x.device)
            h, cond, loglik = m.noisy_input(z, sigma, prev)
            for layer, attn, (k, v) in zip(m.layers_of(b), self.block_attn[b], clean_kv[b]):
                h = self._noisy_layer(layer, attn, h, cond, cos_n, sin_n, k, v)
            if k_step + 1 == self.K:
                break
            logits = m.denoise_logits(h, z, sigma, loglik)
            z = dm.euler_step(z, self._bridge(logits, positions, k_step), self.sigmas[k_step], self.sigmas[k_step + 1])
        last = torch.full((N, 1), self.sigmas[self.K - 1], device=x.device, dtype=h.dtype)
        return torch.cat([h[0], z[0].to(h.dtype), last], dim=-1)

    def _bridge(self, logits, positions, step: int):
        if self.bridge != "sample":
            return self.model.bridge(logits, self.bridge)
        gumbel = positional_gumbel(self.seed, positions, step, logits.shape[-1]).to(logits.device)
        return self.model.targets((logits[0].float() + gumbel).argmax(-1))[None]  # a draw from softmax(logits)

    def compute_logits(self, packed: torch.Tensor) -> torch.Tensor:
        C = self.model.tok_emb.weight.shape[1]
        h, z, sigma = packed[:, :C], packed[:, C:2 * C], packed[:1, 2 * C]
        if h.shape[0] == 0:
            return packed.new_zeros(0, self.model.vocab_size)
        m = self.model
        loglik = m.token_loglik(z[None].float(), sigma.float()) if m.likelihood else None
        return self.model.denoise_logits(h[None], z[None].float(), sigma.float(), loglik)[0].float()

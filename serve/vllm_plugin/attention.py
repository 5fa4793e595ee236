"""One causal self-attention of a native layer through a vLLM `Attention` (its paged KV cache)."""

from __future__ import annotations

import torch

from looped_lm.models.layers import apply_rope


def paged_attention(layer, attn, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, C), the layer's normed input -> (projected attention output (N, C), keys, values (N, C)).
    The keys and values (RoPE applied) are what entered the cache: a DB model's noisy queries reuse them."""
    N, C = x.shape
    H, D = layer.attn.n_heads, layer.attn.head_dim
    q, k, v = layer.attn.qkv(x).view(N, 3, H, D).unbind(1)  # (N, H, D) each
    q, k = layer.attn.norm_qk(q, k)  # Qwen3-style heads: RMSNorm on each q and k before RoPE
    q = apply_rope(q.transpose(0, 1), cos, sin).transpose(0, 1).reshape(N, H * D)  # RoPE on (H, N, D), cos (N, D/2)
    k = apply_rope(k.transpose(0, 1), cos, sin).transpose(0, 1).reshape(N, H * D)
    v = v.reshape(N, H * D)
    y = attn(q, k, v)
    return layer.attn.proj(y.view(N, H * D)), k, v

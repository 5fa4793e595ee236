"""The two-stream transformer layer of the DiffusionBlocks LMs (docs/method.md §4) and its pieces.

A clean stream (the tokens, causal, no sigma conditioning: its K/V never depend on sigma or on K)
and a noisy stream (slot i holds the noisy target x_{i+1}; it attends clean positions <= i and
itself; adaLN-Zero from c_noise) share one set of attention and MLP weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm.models.layers import (AttentionOptions, KVCache, LayerOptions, TransformerLayer, cached_attention,
                                     causal_attention)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class NoiseEmbedding(nn.Module):
    """c_noise (N,) -> conditioning vector (N, d): Fourier features, then an MLP."""

    def __init__(self, d_model: int):
        super().__init__()
        self.n_freqs = d_model // 2
        self.mlp = nn.Sequential(nn.Linear(2 * self.n_freqs, d_model), nn.SiLU(), nn.Linear(d_model, d_model))

    @property
    def freqs(self) -> torch.Tensor:
        """Computed, not a buffer: in fp32 whatever the module's dtype (bf16 frequencies up to 1000 would move the
        angles by radians)."""
        return torch.exp(torch.linspace(0, math.log(1000.0), self.n_freqs, device=self.mlp[0].weight.device))

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        angles = c_noise.float()[:, None] * self.freqs[None]  # the angles in fp32, the MLP in its dtype
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=-1).to(self.mlp[0].weight.dtype))


class TwoStreamLayer(TransformerLayer):
    """A transformer layer that runs a sigma-free clean stream and an adaLN-Zero noisy stream.

    The two streams share the attention and MLP weights (Block Diffusion); only the noisy stream is
    modulated, by shift/scale/gate vectors from the noise embedding (zero-initialised: at init the
    noisy stream passes through unchanged).
    """

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, eps: float,
                 options: LayerOptions | AttentionOptions = LayerOptions()):
        super().__init__(d_model, n_heads, ffn_hidden, eps, options)
        self.ada = nn.Linear(d_model, 6 * d_model)

    def clean(self, x, cos, sin, cache: KVCache | None = None, rows=None, need_output: bool = True):
        """Clean tokens x (R, n, C) after what `cache` holds -> (x_out | None, keys, values so far)."""
        q, k, v = self.attn.project(self.norm1(x), cos, sin)
        mask, window = None, self.attn.window
        if cache is not None:
            k, v, mask = cache.append(k, v, rows, window)
        if not need_output:  # the block's last layer: only its K/V are read (by the noisy stream)
            return None, k, v
        y = cached_attention(q, k, v, mask, window) if cache is not None else causal_attention(q, k, v, window)
        x = x + self.attention_out(self.attn.merge(y))
        return x + self.mlp_out(self.mlp(self.norm2(x))), k, v

    def noisy(self, h, cond, cos, sin, k_ctx, v_ctx, mask, attend_self: bool = True):
        """Noisy slots h (B, n, C) attend context keys k_ctx (B, H, Tc, D) under `mask`, and themselves
        (attend_self; the mask then has Tc + n columns). Without the self key, `mask` covers the context
        only, or is CAUSAL (slot i sees context <= i): plain causal attention, the flash path. A local layer's
        window is in `mask` already (`windowed_slot_mask`, applied by DBNetwork.noisy_pass)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond).unsqueeze(1).chunk(6, dim=-1)
        x = modulate(self.norm1(h), shift1, scale1)
        if attend_self:
            q, k, v = self.attn.project(x, cos, sin)
            if isinstance(mask, str):  # CAUSAL_SELF: every slot of the window, no (T, 2T) mask
                y = causal_plus_self_attention(q, k_ctx, v_ctx, k, v)
            else:
                y = F.scaled_dot_product_attention(q, torch.cat([k_ctx, k], 2), torch.cat([v_ctx, v], 2),
                                                   attn_mask=mask)
        else:
            q = self.attn.project_query(x, cos, sin)
            causal = isinstance(mask, str)
            y = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=None if causal else mask, is_causal=causal)
        h = h + gate1 * self.attention_out(self.attn.merge(y))
        return h + gate2 * self.mlp_out(self.mlp(modulate(self.norm2(h), shift2, scale2)))

    def fused(self, x, h, cond, clean_rope, noisy_rope, cache: KVCache, rows, attend_self: bool,
              need_clean_output: bool):
        """Both streams of a decode step in ONE weight pass: the clean tokens x (R, n, C) a block has not
        cached yet, appended to `cache`, and the noisy slots h (R, m, C), which attend every clean key of
        their row (these included). The same maths as `clean` then `noisy`; each projection runs once on
        the stacked rows instead of twice (decoding is bound by reading the weights)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond).unsqueeze(1).chunk(6, dim=-1)
        R, n, C = x.shape
        H, D = self.attn.n_heads, self.attn.head_dim
        qkv = self.attn.qkv(torch.cat([self.norm1(x), modulate(self.norm1(h), shift1, scale1)], dim=1))
        q, k, v = qkv.view(R, -1, 3, H, D).permute(2, 0, 3, 1, 4)  # (R, H, n + m, D) each
        q, k = self.attn.norm_qk(q, k)
        (cos_c, sin_c), (cos_n, sin_n) = clean_rope, noisy_rope
        window = self.attn.window  # a local layer: the cache's masks hold its window (the slots' too: `view`)
        k_c = self.attn.rope_key(k[:, :, :n], cos_c, sin_c)
        keys, values, clean_mask = cache.append(k_c, v[:, :, :n], rows, window)
        _, _, valid = cache.view(rows, window)
        q_n = self.attn.rope_query(q[:, :, n:], cos_n, sin_n)
        if attend_self:
            k_n = self.attn.rope_key(k[:, :, n:], cos_n, sin_n)
            ones = torch.ones(R, 1, q_n.shape[2], keys.shape[2], dtype=torch.bool, device=x.device)
            mask = torch.cat([ones if valid is None else valid.expand_as(ones),
                              torch.eye(q_n.shape[2], dtype=torch.bool, device=x.device).expand(R, 1, -1, -1)], -1)
            y_n = F.scaled_dot_product_attention(q_n, torch.cat([keys, k_n], 2), torch.cat([values, v[:, :, n:]], 2),
                                                 attn_mask=mask)
        else:
            y_n = F.scaled_dot_product_attention(q_n, keys, values, attn_mask=valid)
        if not need_clean_output:  # the block's last layer: the clean stream only leaves its K/V
            h = h + gate1 * self.attention_out(self.attn.merge(y_n))
            return None, h + gate2 * self.mlp_out(self.mlp(modulate(self.norm2(h), shift2, scale2)))
        y_c = cached_attention(self.attn.rope_query(q[:, :, :n], cos_c, sin_c), keys, values, clean_mask, window)
        out = self.attention_out(self.attn.merge(torch.cat([y_c, y_n], dim=2)))
        x, h = x + out[:, :n], h + gate1 * out[:, n:]
        mlp = self.mlp_out(self.mlp(torch.cat([self.norm2(x), modulate(self.norm2(h), shift2, scale2)], dim=1)))
        return x + mlp[:, :n], h + gate2 * mlp[:, n:]


CAUSAL = "causal"  # a mask value: noisy slot i sees clean keys 0..i (every slot, no self key)
CAUSAL_SELF = "causal+self"  # a mask value: noisy slot i sees clean keys 0..i and its own noisy key


SINK_PAD = 8  # head-dim padding of the sink's column: flash kernels take head dims in multiples of 8


def causal_plus_self_attention(q, k, v, k_self, v_self):
    """Slot i of q (B, H, T, D) attends keys 0..i of (k, v) and its own (k_self, v_self)[i], without the
    (T, 2T) mask of the concatenated keys. One causal SDPA call (is_causal: the flash path)
    against the clean keys with one extra key in front, of score 0 (a "sink" every slot sees), whose value
    is 1 in an extra column: that column comes out as w = 1 / (Z + 1), Z the slot's clean softmax
    normaliser, and the self term merges by its own score:
        y = (y_clean + a v_self) / (1 - w + a),   a = w exp(q . k_self / sqrt(D))
    (y_clean: the sink-diluted clean average). Exactly softmax over [clean keys <= i, self], forward and
    backward, for every slot whose clean normaliser Z stays below fp32's range (scores below ~88; beyond,
    w underflows and the self term is lost). The extra column is padded to SINK_PAD (zeros in q and k
    leave every score as it was): attention costs (D + SINK_PAD) / D of the clean keys' alone."""
    B, H, T, D = q.shape
    pad = q.new_zeros(B, H, T, SINK_PAD)
    first = q.new_zeros(B, H, 1, D + SINK_PAD)  # the sink's key, and a dummy query in front (dropped): the
    # call is then square and plainly causal, so query i + 1 sees the sink and clean keys 0..i
    sink_v = torch.cat([q.new_zeros(B, H, 1, D), q.new_ones(B, H, 1, 1), q.new_zeros(B, H, 1, SINK_PAD - 1)], -1)
    out = F.scaled_dot_product_attention(
        torch.cat([first, torch.cat([q, pad], -1)], 2), torch.cat([first, torch.cat([k, pad], -1)], 2),
        torch.cat([sink_v, torch.cat([v, pad], -1)], 2), is_causal=True, scale=1 / math.sqrt(D))[:, :, 1:]
    acc = torch.promote_types(q.dtype, torch.float32)  # bf16 / fp16 merge in fp32
    y_clean, w = out[..., :D].to(acc), out[..., D:D + 1].to(acc)
    score = (q.to(acc) * k_self.to(acc)).sum(-1, keepdim=True) / math.sqrt(D)
    a = torch.exp((score + w.log()).clamp(max=80.0))  # beyond e^80 the self term is all there is
    return ((y_clean + a * v_self.to(acc)) / (1 - w + a)).to(q.dtype)


def slot_mask(ctx_end: torch.Tensor, n_clean: int, attend_self: bool, full_window: bool | None = None):
    """The noisy stream's mask: `noisy_mask`, or without the self key its clean columns; CAUSAL (no self
    key) or CAUSAL_SELF when every slot of the window is there, so no mask exists. full_window: the
    caller knows ctx_end is arange(n_clean) (or is not); None reads the tensor to find out, which syncs
    with the device."""
    if full_window is None:
        full_window = ctx_end.dim() == 1 and ctx_end.shape[0] == n_clean and bool(
            (ctx_end == torch.arange(n_clean, device=ctx_end.device)).all())
    if attend_self:
        return CAUSAL_SELF if full_window else noisy_mask(ctx_end, n_clean)
    if full_window:
        return CAUSAL
    return noisy_mask(ctx_end, n_clean)[..., :n_clean]


def noisy_mask(ctx_end: torch.Tensor, n_clean: int) -> torch.Tensor:
    """Slot s sees clean keys j <= ctx_end[..., s] and its own noisy key only.

    ctx_end: (n,) shared by the batch -> mask (n, n_clean + n); or (B, n) -> (B, 1, n, n_clean + n).
    """
    n = ctx_end.shape[-1]
    clean = torch.arange(n_clean, device=ctx_end.device) <= ctx_end[..., None]
    own = torch.eye(n, dtype=torch.bool, device=ctx_end.device).expand(*ctx_end.shape[:-1], n, n)
    mask = torch.cat([clean, own], dim=-1)
    return mask if ctx_end.dim() == 1 else mask.unsqueeze(1)


def windowed_slot_mask(mask, positions: torch.Tensor, n_clean: int, window: int):
    """The noisy stream's `mask` for a local layer (Gemma 3's sliding window): a slot at RoPE position p (its
    `positions`, (n,) or (R, n)) also loses the clean keys j <= p - window. The clean keys sit at their own
    positions 0..n_clean - 1 (a window's, or a cache's) and p <= n_clean, so with n_clean < window nothing is lost
    and `mask` comes back as it is; else a bool tensor (CAUSAL / CAUSAL_SELF made explicit: no flash path), its
    self columns, if any, kept."""
    if n_clean < window:
        return mask
    keys = torch.arange(n_clean, device=positions.device)
    recent = keys > positions[..., None] - window  # (n, Tc) or (R, n, Tc)
    if isinstance(mask, str):  # slot i, at position i + 1, sees the clean keys <= i
        clean = recent & (keys < positions[..., None])
        if mask == CAUSAL_SELF:
            n = positions.shape[-1]
            own = torch.eye(n, dtype=torch.bool, device=positions.device).expand(*positions.shape[:-1], n, n)
            clean = torch.cat([clean, own], dim=-1)
        return clean if positions.dim() == 1 else clean.unsqueeze(1)
    if positions.dim() == 2:
        recent = recent.unsqueeze(1)  # (R, 1, n, Tc)
    if mask is None:
        return recent
    clean = mask[..., :n_clean] & recent
    if mask.shape[-1] == n_clean:
        return clean
    return torch.cat([clean, mask[..., n_clean:].expand(*clean.shape[:-1], -1)], dim=-1)

"""Building blocks shared by every model: RMSNorm, RoPE, attention with a KV cache, SwiGLU (and the options
the source families add to Llama's layer: AttentionOptions, LayerOptions).

Single-device PyTorch only: nothing here knows about DeepSpeed, files or HTTP.
Shapes: B batch, T time, H heads, D head dim, C = H * D model width.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def ffn_width(d_model: int, ffn_hidden: int) -> int:
    """SwiGLU hidden width: 8/3 d rounded up to a multiple of 64 (Llama's rule), unless given."""
    if ffn_hidden > 0:
        return ffn_hidden
    return 64 * math.ceil(8 * d_model / 3 / 64)


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose lookups are multiplied by `scale` (Gemma: sqrt(d_model)), the float32 scale rounded to
    the table's dtype as transformers' Gemma does; the table itself (a tied head, the DiffusionBlocks targets) is
    read unscaled. scale 1: a plain embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.scaled(super().forward(ids))

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """x in the table's units (rows, or a mix of them) -> as the residual stream reads a looked-up row."""
        if self.scale == 1.0:
            return x
        return x * torch.tensor(self.scale, device=x.device).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables for any position up to `max_len`, looked up by an explicit position tensor.

    With `local_theta` (Gemma 3: its local sliding-window layers rotate with a base of their own) each lookup
    holds both bases' tables side by side, (..., D) instead of (..., D/2), the global base first; every
    Attention takes its own half (`Attention.rope_tables`), so the callers pass one (cos, sin) to every layer."""

    def __init__(self, head_dim: int, max_len: int, theta: float, local_theta: float = 0.0):
        super().__init__()
        positions = torch.arange(max_len, dtype=torch.float64)
        angles = torch.cat([torch.outer(positions, 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                                                     / head_dim)))
                            for base in ([theta, local_theta] if local_theta else [theta])], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (max_len, D/2 per base)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) or (B, T) int, each below the table's max_len -> cos, sin broadcastable to
        (B, H, T, D/2) (D with a local base). Not checked here (reading the tensor's max would sync the host with the device in
        every layer): the callers' positions are bounded by seq_len and by the caches' lengths."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 2:  # (B, T, D/2) -> (B, 1, T, D/2)
            return cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of x (B, H, T, D) by the position angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class KVCache:
    """Preallocated keys and values of one attention layer: (B, H, max_len, D).

    Each row (one sequence, or one serving slot) has its own length, so rows at different positions
    decode in one batch. `rows` selects the rows a call touches (None = all of them).
    """

    def __init__(self, batch: int, n_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        """The common length when every row holds the same number of tokens (single-sequence use)."""
        return int(self.lengths.max())

    def _rows(self, rows):
        return torch.arange(self.k.shape[0], device=self.k.device) if rows is None else rows

    @staticmethod
    def _contiguous(rows):
        """rows as a slice when they are consecutive (a view instead of a gathered copy), else None."""
        if rows is None:
            return slice(None)
        first, n = int(rows[0]), rows.shape[0]
        if int(rows[-1]) - first == n - 1 and (n < 3 or bool((rows.diff() == 1).all())):
            return slice(first, first + n)
        return None

    def append(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None, window: int = 0):
        """Store k, v (R, H, n, D) after each row's length -> (keys, values, mask) for its queries.

        keys, values: (R, H, L, D), L = the longest row now. mask: None when the rows are aligned
        (plain causal attention over the newest n: `causal_attention` applies a window itself), else
        (R, 1, n, L): query i of row r sees the keys j <= start_r + i, and nothing past the row's end (with a
        window W, only the keys j > start_r + i - W).
        """
        idx, n = self._rows(rows), k.shape[2]
        start = self.lengths[idx]
        if int(start.max()) + n > self.k.shape[2]:
            raise ValueError(f"KV cache full: {int(start.max())} + {n} > {self.k.shape[2]} positions")
        self.lengths[idx] = start + n
        if bool((start == start[0]).all()):
            s, block = int(start[0]), self._contiguous(rows)
            if block is not None:
                self.k[block, :, s:s + n], self.v[block, :, s:s + n] = k, v
                return self.k[block, :, :s + n], self.v[block, :, :s + n], None
            self.k[idx, :, s:s + n], self.v[idx, :, s:s + n] = k, v
            return self.k[idx, :, :s + n], self.v[idx, :, :s + n], None
        pos = start[:, None] + torch.arange(n, device=start.device)  # (R, n)
        self.k[idx[:, None], :, pos] = k.transpose(1, 2)
        self.v[idx[:, None], :, pos] = v.transpose(1, 2)
        L = int(pos.max()) + 1
        keys = torch.arange(L, device=start.device)[None, None, :]
        mask = keys <= pos[:, :, None]
        if window:
            mask = mask & (keys > pos[:, :, None] - window)
        block = self._contiguous(rows)
        if block is not None:
            return self.k[block, :, :L], self.v[block, :, :L], mask[:, None]
        return self.k[idx, :, :L], self.v[idx, :, :L], mask[:, None]

    def append_fixed(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, window: int = 0):
        """One new token per row, k, v (R, H, 1, D), for a compiled decode step: no host reads, and every
        shape fixed by R and the cache's max_len M, so one graph serves every step. -> (keys, values, mask):
        (R, H, M, D) twice and (R, 1, 1, M), True over each row's filled positions (with a window W, the last W
        of them). A row may appear more than
        once (a padded batch) as long as each copy brings the same k, v. The caller keeps rows within max_len
        (the engine's scheduler does; checking here would read the lengths on the host)."""
        pos = self.lengths[rows]  # (R,)
        self.k[rows, :, pos] = k[:, :, 0]
        self.v[rows, :, pos] = v[:, :, 0]
        self.lengths[rows] = pos + 1
        keys = torch.arange(self.k.shape[2], device=pos.device)[None, :]
        mask = keys <= pos[:, None]
        if window:
            mask = mask & (keys > pos[:, None] - window)
        return self.k[rows], self.v[rows], mask[:, None, None, :]

    def view(self, rows: torch.Tensor | None = None, window: int = 0):
        """(keys, values, valid) of the selected rows, for a query at each row's next position (its length);
        valid is None when they are aligned, else (R, 1, 1, L) marking each row's filled positions (with a
        window W, the keys within W - 1 positions before the query only: a mask even for aligned rows once
        L >= W)."""
        idx = self._rows(rows)
        lengths = self.lengths[idx]
        L = int(lengths.max())
        keys = torch.arange(L, device=lengths.device)[None, :]
        valid = None
        if not bool((lengths == L).all()):
            valid = keys < lengths[:, None]
        if window and L >= window:
            recent = keys > lengths[:, None] - window
            valid = recent if valid is None else valid & recent
        valid = None if valid is None else valid[:, None, None, :]
        block = self._contiguous(rows)
        if block is not None:
            return self.k[block, :, :L], self.v[block, :, :L], valid
        return self.k[idx, :, :L], self.v[idx, :, :L], valid

    def reset(self, rows: torch.Tensor | None = None) -> None:
        """Free rows for new sequences (their stale keys are masked out by the lengths)."""
        self.lengths[self._rows(rows)] = 0

    def nbytes_per_token(self) -> int:
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()


class FixedShapeRows:
    """A KVCache as a compiled decode step sees it: `append` is `append_fixed` (the layers call `append`)."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def append(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, window: int = 0):
        return self.cache.append_fixed(k, v, rows, window)

    def view(self, rows: torch.Tensor, window: int = 0):
        """(keys, values, valid) over the cache's whole length M: (R, H, M, D) twice and (R, 1, 1, M), True
        over each row's filled positions (with a window W, the last W - 1 of them: the query is the next)."""
        c = self.cache
        keys, lengths = torch.arange(c.k.shape[2], device=c.lengths.device)[None, :], c.lengths[rows][:, None]
        valid = keys < lengths
        if window:
            valid = valid & (keys > lengths - window)
        return c.k[rows], c.v[rows], valid[:, None, None, :]


def positions_after(lengths: torch.Tensor, rows, n: int, device) -> torch.Tensor:
    """Positions of n new tokens after each row's `lengths`: (n,) when the rows are aligned, else (R, n)."""
    start = lengths if rows is None else lengths[rows]
    if bool((start == start[0]).all()):
        return torch.arange(int(start[0]), int(start[0]) + n, device=device)
    return start[:, None].to(device) + torch.arange(n, device=device)


def cached_attention(q, k, v, mask, window: int = 0):
    """Attention of new queries against a cache's output: causal when aligned, masked otherwise (the cache's
    mask already holds the window of a local layer)."""
    if mask is None:
        return causal_attention(q, k, v, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_attention(q, k, v, window: int = 0):
    """The newest n queries (B, H, n, D) over all keys so far (B, H, past + n, D), causally; with a window W
    (a local layer), query p sees keys j with p - W < j <= p only (transformers' sliding_window_overlay)."""
    n, total = q.shape[2], k.shape[2]
    if window and total > window:  # some query's oldest keys are out of its window: an explicit band
        keys = torch.arange(total, device=q.device)
        queries = keys[total - n:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(keys <= queries) & (keys > queries - window))
    if n == total:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if n == 1:  # the newest token sees every key
        return F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Linear(nn.Linear):
    """nn.Linear whose inference product on CPU runs through oneDNN's prepacked weight layout (fp32, no
    gradient, 2+ rows, a weight of PACK_MIN_ELEMENTS or more), as vLLM's CPU build does: the engine's decode of
    a 6 x 256 model at batch 16 runs ~1.2x faster with the layers' weights packed (bench/README.md). The packed
    copy is a cache beside the module (made on first use, rebuilt when the weight changes), never in its state.
    A module in training mode takes F.linear even without a gradient (a stacked DB block's feeders run so every
    step: packing weights that change each step would cost a reorder per step, and FlopCounterMode does not
    count oneDNN's op); so do compiled graphs and one-row products."""

    PACK_MIN_ELEMENTS = 1 << 17  # smaller weights (d 256 -> 256) gain nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.training or torch.is_grad_enabled() or torch.compiler.is_compiling() or x.numel() < 2 * x.shape[-1]
                or not packable(self.weight, x, self.PACK_MIN_ELEMENTS)):
            return F.linear(x, self.weight, self.bias)
        key = table_key(self.weight)
        cached = _PACKED.get(self)
        if cached is None or cached[0] != key:
            cached = _PACKED[self] = key, pack(self.weight)
        return packed_product(x, cached[1], self.bias)


# module -> (its weight's table_key, the packed weight): beside the modules, so copying or saving one never meets
# an opaque tensor, and a module's entry goes with it
_PACKED: "weakref.WeakKeyDictionary[Linear, tuple]" = weakref.WeakKeyDictionary()


def pack(table: torch.Tensor) -> torch.Tensor:
    """A (V, d) table in oneDNN's prepacked layout for products x @ table.T (an opaque tensor: it cannot be
    copied or saved)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(table, None)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., d) @ table.T (+ bias) from `pack(table)`."""
    rows = x.numel() // x.shape[-1]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def table_key(table: torch.Tensor) -> tuple:
    """Changes whenever the table does: its storage, in-place version, dtype or device."""
    return table.data_ptr(), table._version, table.dtype, table.device


def packable(table: torch.Tensor, x: torch.Tensor, min_elements: int) -> bool:
    return (table.device.type == "cpu" and table.dtype == x.dtype == torch.float32 and table.numel() >= min_elements
            and torch.backends.mkldnn.is_available())


@dataclass(frozen=True)
class AttentionOptions:
    """What the source families add to Llama's attention, each an option of the one Attention: biases on the
    q, k and v projections (Qwen2 / Qwen2.5), an RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3),
    a head width apart from d_model / n_heads (Qwen3, Gemma 3; 0 = d_model / n_heads), and scores scaled by
    scalar ** -0.5 instead of head_dim ** -0.5 (Gemma 3's query_pre_attn_scalar; 0 = head_dim). Which layers are
    local (a sliding window, a RoPE base of their own) is per layer: `mark_local_layers`."""

    head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    scalar: float = 0.0

    @classmethod
    def of(cls, model_section) -> "AttentionOptions":
        """From a language model's `model:` section (its head_dim, qkv_bias, qk_norm and attn_scalar fields)."""
        return cls(model_section.head_dim, model_section.qkv_bias, model_section.qk_norm, model_section.attn_scalar)

    def width(self, d_model: int, n_heads: int) -> int:
        return self.head_dim or d_model // n_heads


@dataclass(frozen=True)
class LayerOptions:
    """What the source families change in Llama's layer, each an option of the one TransformerLayer: its
    attention's (AttentionOptions), an RMSNorm on the attention's and on the MLP's output before each residual
    add (sandwich_norm: Gemma 3's post_attention_layernorm and post_feedforward_layernorm), and the gated MLP's
    activation (silu: SwiGLU; gelu_tanh: GeGLU with gelu's tanh approximation, Gemma)."""

    attention: AttentionOptions = AttentionOptions()
    sandwich_norm: bool = False
    activation: str = "silu"

    @classmethod
    def of(cls, model_section) -> "LayerOptions":
        """From a language model's `model:` section."""
        return cls(AttentionOptions.of(model_section), model_section.sandwich_norm, model_section.mlp_activation)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, options: AttentionOptions = AttentionOptions(), eps: float = 1e-6):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, options.width(d_model, n_heads)
        inner = n_heads * self.head_dim
        self.qkv = Linear(d_model, 3 * inner, bias=options.qkv_bias)
        if options.qkv_bias:
            nn.init.zeros_(self.qkv.bias)  # a fresh model's biases start at 0 (a source's are copied in)
        self.proj = Linear(inner, d_model, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=eps) if options.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=eps) if options.qk_norm else None
        # every attention product divides by sqrt(head_dim) (SDPA's default): a scalar apart scales q instead, once
        scalar = options.scalar or self.head_dim
        self.query_scale = None if scalar == self.head_dim else math.sqrt(self.head_dim / scalar)
        self.local, self.window = False, 0  # a local layer: the local RoPE base, and a sliding window (0 = none)

    def rope_tables(self, cos, sin):
        """This layer's RoPE tables from the model's lookup: with two bases (RotaryEmbedding's local_theta) the
        lookup holds both side by side, and a local layer takes the second half."""
        half = self.head_dim // 2
        if cos.shape[-1] == half:
            return cos, sin
        part = slice(half, None) if self.local else slice(None, half)
        return cos[..., part], sin[..., part]

    def rope_query(self, q: torch.Tensor, cos, sin) -> torch.Tensor:
        """q (..., D) with RoPE, scaled for the layer's score scale (AttentionOptions.scalar)."""
        q = apply_rope(q, *self.rope_tables(cos, sin))
        return q if self.query_scale is None else q * self.query_scale

    def rope_key(self, k: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(k, *self.rope_tables(cos, sin))

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor):
        """q, k (..., D): each head's RMSNorm (qk_norm), before RoPE; unchanged without it."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def project(self, x: torch.Tensor, cos, sin):
        """x (B, T, C) -> q, k, v (B, H, T, D), with RoPE applied to q and k."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.norm_qk(q, k)
        return self.rope_query(q, cos, sin), self.rope_key(k, cos, sin), v

    def project_query(self, x: torch.Tensor, cos, sin):
        """x (B, T, C) -> q (B, H, T, D) with RoPE, from the query rows of qkv only."""
        B, T, C = x.shape
        inner = self.n_heads * self.head_dim
        if not isinstance(self.qkv, nn.Linear):  # wrapped by an adapter (looped_lm/lora.py): the whole product
            q = self.qkv(x)[..., :inner]
        else:
            q = F.linear(x, self.qkv.weight[:inner], None if self.qkv.bias is None else self.qkv.bias[:inner])
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return self.rope_query(q, cos, sin)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """y (B, H, T, D) -> (B, T, C) through the output projection."""
        B, H, T, D = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x, cos, sin, cache: KVCache | None = None, rows=None):
        """Causal self-attention (within the window of a local layer); with a cache, x holds each row's newest
        positions only."""
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            return self.merge(causal_attention(q, k, v, self.window))
        return self.merge(cached_attention(q, *cache.append(k, v, rows, self.window), self.window))


class SwiGLU(nn.Module):
    """The gated MLP, down(act(gate) * up): act silu (SwiGLU, Llama) or gelu_tanh (GeGLU, Gemma: transformers'
    gelu_pytorch_tanh)."""

    def __init__(self, d_model: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.gate_up = Linear(d_model, 2 * hidden, bias=False)
        self.down = Linear(hidden, d_model, bias=False)
        self.activation = activation

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate)
        return self.down(act * up)


class TransformerLayer(nn.Module):
    """Pre-norm attention + SwiGLU (with sandwich_norm, each branch's output normed too). The two-stream
    DiffusionBlocks layer reuses these parts. `options` may be an AttentionOptions alone (Llama's layer)."""

    def __init__(self, d_model: int, n_heads: int, ffn_hidden: int, eps: float,
                 options: LayerOptions | AttentionOptions = LayerOptions()):
        super().__init__()
        options = options if isinstance(options, LayerOptions) else LayerOptions(options)
        self.norm1 = nn.RMSNorm(d_model, eps=eps)
        self.attn = Attention(d_model, n_heads, options.attention, eps)
        self.norm2 = nn.RMSNorm(d_model, eps=eps)
        self.mlp = SwiGLU(d_model, ffn_hidden, options.activation)
        self.post_norm1 = nn.RMSNorm(d_model, eps=eps) if options.sandwich_norm else None  # on the attention's output
        self.post_norm2 = nn.RMSNorm(d_model, eps=eps) if options.sandwich_norm else None  # on the MLP's output

    def attention_out(self, y: torch.Tensor) -> torch.Tensor:
        """The attention's output as the residual stream takes it: normed with sandwich_norm."""
        return y if self.post_norm1 is None else self.post_norm1(y)

    def mlp_out(self, y: torch.Tensor) -> torch.Tensor:
        """The MLP's output as the residual stream takes it: normed with sandwich_norm."""
        return y if self.post_norm2 is None else self.post_norm2(y)

    def forward(self, x, cos, sin, cache: KVCache | None = None, rows=None):
        x = x + self.attention_out(self.attn(self.norm1(x), cos, sin, cache, rows))
        return x + self.mlp_out(self.mlp(self.norm2(x)))


def mark_local_layers(net: nn.Module, plan: dict[str, list], layer_types: list[str], window: int) -> None:
    """Gemma 3's local layers: every layer of `net` that `plan` (the kind's layer plan, {part: source layer
    indices}, parts named as the network's layer lists) takes from a "sliding_attention" entry of `layer_types`
    attends within `window` positions and reads the local RoPE base; the others stay global."""
    for part, indices in plan.items():
        layers = net.get_submodule(part)
        if part == "blocks":  # a list of layer lists
            layers, indices = [l for block in layers for l in block], [i for block in indices for i in block]
        for layer, i in zip(layers, indices, strict=True):
            local = layer_types[i] == "sliding_attention"
            layer.attn.local, layer.attn.window = local, window if local else 0


class OutputHead:
    """The head of a language model: the token embedding transposed (tied, Llama's tie_word_embeddings), or a
    separate `lm_head` (untied). Every product of the head reads `head_weight`; the embedding stays the table of
    the inputs (and, for the DiffusionBlocks models, of the noisy targets). `make_head` runs in the model's
    __init__ (an nn.Module's submodule cannot be a class attribute)."""

    def make_head(self, d_model: int, vocab_size: int, tied: bool) -> None:
        self.lm_head = None if tied else nn.Linear(d_model, vocab_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight


class TransposedCopy:
    """A contiguous (d, V) copy of a (V, d) table (or of `fn(table)`), for inference products `x @ table.T`:
    on CPU they run up to ~2.5x faster from a contiguous transpose than through F.linear at decode sizes
    (bench/README.md). Rebuilt whenever the table changes (its storage or in-place version); costs one
    extra copy of the table. Not a buffer: checkpoints never see it.

    `product(x, table)` is that product. On CPU, for a large fp32 table and more than one row, it runs
    through oneDNN's prepacked weight layout instead (`mkldnn._linear_pointwise`, what vLLM's CPU build
    uses): at V 50257, d 256 it takes 6 ms for 16 rows where the transpose takes 12 and F.linear 15, while
    for one row the transpose is fastest (bench/README.md). The packed copy is a second copy, made on
    first use.

    Inside a compiled graph the copy cannot be checked against the table (that reads pointers), so a graph
    recomputes fn(table).T on every call, unless the copy is `frozen`: the engine's compiled decode freezes it
    (the weights do not change while it serves), and the graph reads the frozen copy."""

    PACK_MIN_ELEMENTS = 1 << 20  # below ~1M entries (the byte vocabulary's tables) packing gains nothing

    def __init__(self, fn=None):
        self.fn, self.key, self.value, self.frozen = fn, None, None, False
        self.packed_key, self.packed = None, None

    def __deepcopy__(self, memo) -> "TransposedCopy":
        return TransposedCopy(self.fn)  # a cache: a copy starts empty (oneDNN's packed tensors cannot be copied)

    def __getstate__(self) -> dict:
        return {"fn": self.fn}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fn"])

    def freeze(self, table: torch.Tensor) -> torch.Tensor:
        """Make the copy of `table` now and let compiled graphs read it (until `thaw`) -> the copy."""
        self.frozen = False  # the eager path below: it rebuilds the copy if the table changed
        self(table)
        self.frozen = True
        return self.value

    def thaw(self) -> None:
        self.frozen = False

    def __call__(self, table: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.value if self.frozen else (table if self.fn is None else self.fn(table)).T
        key = table_key(table)
        if key != self.key:
            with torch.no_grad():
                self.value = (table if self.fn is None else self.fn(table)).T.contiguous()
            self.key = key
        return self.value

    def product(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """x (..., d) @ fn(table).T -> (..., V), at inference."""
        if (x.numel() < 2 * x.shape[-1] or torch.compiler.is_compiling()
                or not packable(table, x, self.PACK_MIN_ELEMENTS)):
            return x @ self(table)
        key = table_key(table)
        if key != self.packed_key:
            self.packed = pack(table if self.fn is None else self.fn(table))
            self.packed_key = key
        return packed_product(x, self.packed)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CE per token: logits (B, T, V), targets (B, T) -> (B, T), in fp32, on contiguous rows (a
    (B, V, T) transpose makes the softmax stride across memory and runs several times slower)."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.float().reshape(B * T, V), targets.reshape(B * T), reduction="none").view(B, T)


def chunked(fn, chunk: int, *tensors, dim: int = 1) -> torch.Tensor:
    """fn over slices of `tensors` along `dim`, `chunk` at a time, each under activation checkpointing:
    only the slices are saved for backward and fn's inside (e.g. a (tokens, V) logits tensor) is
    recomputed, so it never exists for more than one chunk. chunk <= 0: one plain call."""
    if chunk <= 0 or tensors[0].shape[dim] <= chunk:
        return fn(*tensors)
    n = tensors[0].shape[dim]
    parts = [checkpoint(fn, *(t.narrow(dim, s, min(chunk, n - s)) for t in tensors), use_reentrant=False)
             for s in range(0, n, chunk)]
    return torch.cat(parts, dim=dim)


def init_weights(module: nn.Module, std: float, n_residual_layers: int) -> None:
    """GPT-2 init: normal(std) everywhere, output projections scaled by 1/sqrt(2 * layers)."""
    for name, p in module.named_parameters():
        if p.dim() < 2:
            continue  # norms keep their ones
        if name.endswith(("proj.weight", "down.weight")):
            nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * n_residual_layers))
        else:
            nn.init.normal_(p, mean=0.0, std=std)

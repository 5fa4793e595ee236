"""The end-to-end baseline: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, tied head, SDPA).

Read top to bottom like nanoGPT's model.py. `forward` trains and scores; `prefill` / `decode_step`
run the same network against per-layer KV caches for generation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from looped_lm.errors import UserError
from looped_lm.models.args import GPTArgs
from looped_lm.models.contract import CachedDecoding, FixedShapeDecoding, Scorable, TokenScores, Trainable
from looped_lm.models.layers import (FixedShapeRows, OutputHead, KVCache, RotaryEmbedding, ScaledEmbedding,
                                     TransformerLayer, TransposedCopy, chunked, ffn_width, init_weights, positions_after,
                                     token_cross_entropy)


class GPT(nn.Module, OutputHead, Trainable, Scorable, CachedDecoding, FixedShapeDecoding):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.args = args
        self.loss_chunk = args.loss_chunk  # training: head + CE per chunk of positions, recomputed in backward
        self.activation_checkpointing = args.activation_checkpointing  # training: each layer recomputed in backward
        self.seq_len, self.vocab_size, self.n_heads = args.seq_len, args.vocab_size, args.n_heads
        self.max_positions = args.positions  # generation may run past the training length
        self.tok_emb = ScaledEmbedding(args.vocab_size, args.d_model, args.embed_scale)
        self.layers = nn.ModuleList(
            TransformerLayer(args.d_model, args.n_heads, ffn_width(args.d_model, args.ffn_hidden), args.norm_eps,
                             args.layer)
            for _ in range(args.n_layers))
        self.head_dim = args.layer.attention.width(args.d_model, args.n_heads)
        self.norm = nn.RMSNorm(args.d_model, eps=args.norm_eps)
        self.rope = RotaryEmbedding(self.head_dim, self.max_positions, args.rope_theta, args.rope_local_theta)
        self.make_head(args.d_model, args.vocab_size, args.tie_embeddings)  # tied: the token embedding, transposed
        init_weights(self, args.init_std, args.n_layers)
        self.head_t = TransposedCopy()  # inference only
        if args.local_layers:  # Gemma 3's sliding-window layers
            args.local_layers.apply(self)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(self.norm(h), self.head_weight)
        return self.head_t.product(self.norm(h), self.head_weight)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) -> the last layer's output (B, T, C), before the final norm."""
        T = idx.shape[1]
        cos, sin = self.rope(torch.arange(T, device=idx.device))
        h = self.tok_emb(idx)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False) if recompute else layer(h, cos, sin)
        return h

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) -> logits (B, T, V); with targets, also the mean next-token CE."""
        logits = self.logits(self.hidden(idx))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    def training_loss(self, x, y, step: int, seed: int):
        """The trainer's entry point, shared by every model kind: (loss, metrics)."""
        if self.loss_chunk:  # the (B, T, V) logits never exist whole
            ce = chunked(lambda h, t: token_cross_entropy(self.logits(h), t), self.loss_chunk, self.hidden(x), y)
            return ce.mean(), {}
        _, loss = self(x, y)
        return loss, {}

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        return self(x, y)[1]

    # --- scoring: exact ----------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, x, y, settings, generator=None) -> dict:
        if settings.k_grid:
            raise UserError("this model is end-to-end (gpt): it takes no K (--num-iterations)", "num_iterations")
        return {"exact": TokenScores(token_cross_entropy(self(x)[0], y))}

    @torch.no_grad()
    def token_logprobs(self, x, y, settings, num_iterations=None, generator=None) -> torch.Tensor:
        return self(x)[0].float().log_softmax(-1)

    # --- generation with a KV cache -------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> "GPTCache":
        p = self.tok_emb.weight
        return GPTCache([KVCache(batch, self.n_heads, max_len, self.head_dim, p.device, p.dtype) for _ in self.layers])

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: "GPTCache", rows=None) -> torch.Tensor:
        """Run new tokens idx (R, n) after what the caches hold (for `rows`, default all); return their
        logits (R, n, V)."""
        return self.logits(self._decode_hidden(idx, cache, rows))

    def _decode_hidden(self, idx: torch.Tensor, cache: "GPTCache", rows) -> torch.Tensor:
        caches = cache.layers
        cos, sin = self.rope(positions_after(caches[0].lengths, rows, idx.shape[1], idx.device))
        h = self.tok_emb(idx)
        for layer, c in zip(self.layers, caches):
            h = layer(h, cos, sin, c, rows)
        return h

    @torch.no_grad()
    def decode_fixed(self, idx: torch.Tensor, cache: "GPTCache", rows: torch.Tensor) -> torch.Tensor:
        """`forward_cached` for one token per row with static shapes and no host reads (compiled by the
        engine): each row attends over the cache's whole length, masked to its own filled positions."""
        cos, sin = self.rope(cache.layers[0].lengths[rows][:, None])
        h = self.tok_emb(idx)
        for layer, c in zip(self.layers, cache.layers):
            h = layer(h, cos, sin, FixedShapeRows(c), rows)
        return F.linear(self.norm(h[:, -1]), self.head_weight)  # not head_t: its cache key reads pointers

    @torch.no_grad()
    def forward_cached(self, idx: torch.Tensor, cache: "GPTCache", rows=None, batch=None,
                       want_logits: bool = True) -> torch.Tensor:
        """`decode`, keeping the logits (R, V) after the last new token (a prompt's earlier positions never
        pass through the head: at V 50257 that product is most of a prefill)."""
        h = self._decode_hidden(idx, cache, rows)
        return self.logits(h[:, -1]) if want_logits else None

    def reset_rows(self, cache: "GPTCache", rows) -> None:
        for c in cache.layers:
            c.reset(rows)


class GPTCache:
    """Per-layer KV caches of a batch of rows."""

    def __init__(self, layers: list[KVCache]):
        self.layers = layers

    def nbytes_per_token(self) -> int:
        return sum(c.nbytes_per_token() for c in self.layers)


def build(args: GPTArgs, state: dict | None = None) -> GPT:
    return GPT(args)

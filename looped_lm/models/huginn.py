"""The recurrent-depth baseline, trained as Huginn is (Geiping et al. 2025): truncated BPTT.

    tokens -> embedding -> prelude (n_prelude layers) -> e
    s_0 ~ N(0, init_scale^2)                              random initial state
    s_i = core(adapter(cat[s_{i-1}, e]))  for i = 1..r   weight-tied core (n_layers layers)
    coda (n_coda layers) -> norm -> tied head

Training draws r per step from a Poisson-log-normal with mean `mean_recurrence` and backpropagates
through the last `backprop_depth` iterations only (the first r - k run without gradient). Every
iteration's core layers attend causally over the same iteration's keys, so the KV cache holds one
entry per (iteration, layer): its size grows with K, unlike the DiffusionBlocks looped model.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from looped_lm.errors import UserError
from looped_lm.models.args import HuginnArgs
from looped_lm.models.contract import CachedDecoding, Iterative, Scorable, TokenScores, Trainable
from looped_lm.settings import IterationLimits, RowBatch
from looped_lm.models.layers import (KVCache, OutputHead, RotaryEmbedding, ScaledEmbedding, TransformerLayer,
                                     TransposedCopy, ffn_width, init_weights, positions_after, token_cross_entropy)


def sample_recurrence(mean: int, generator: torch.Generator, sigma: float = 0.5) -> int:
    """r = 1 + Poisson(exp(tau)), tau ~ N(log(mean - 1) - sigma^2/2, sigma): Huginn's heavy-tailed draw.

    E[exp(tau)] = mean - 1, so E[r] = mean; r >= 1 always.
    """
    if mean <= 1:
        return 1
    tau = torch.randn((), generator=generator, dtype=torch.float64) * sigma + math.log(mean - 1) - sigma ** 2 / 2
    return 1 + int(torch.poisson(tau.exp().reshape(1), generator=generator).item())


class HuginnLM(nn.Module, OutputHead, Trainable, Scorable, CachedDecoding, Iterative):
    def __init__(self, args: HuginnArgs):
        super().__init__()
        self.args, self.vocab_size, self.n_heads = args, args.vocab_size, args.n_heads
        self.seq_len, self.max_iterations = args.seq_len, args.limits.max_iterations
        self.max_positions = args.positions  # generation may run past the training length
        self.mean_recurrence, self.backprop_depth = args.mean_recurrence, args.backprop_depth
        self.init_scale = 1.0  # std of the random initial state, as Huginn's default
        ffn = ffn_width(args.d_model, args.ffn_hidden)
        self.head_dim = args.layer.attention.width(args.d_model, args.n_heads)

        def stack(n):
            return nn.ModuleList(TransformerLayer(args.d_model, args.n_heads, ffn, args.norm_eps, args.layer)
                                 for _ in range(n))

        self.tok_emb = ScaledEmbedding(args.vocab_size, args.d_model, args.embed_scale)
        self.prelude, self.core, self.coda = stack(args.n_prelude), stack(args.n_layers), stack(args.n_coda)
        self.adapter = nn.Linear(2 * args.d_model, args.d_model, bias=False)
        self.norm = nn.RMSNorm(args.d_model, eps=args.norm_eps)
        self.rope = RotaryEmbedding(self.head_dim, self.max_positions, args.rope_theta, args.rope_local_theta)
        self.head_t = TransposedCopy()  # inference only
        self.make_head(args.d_model, args.vocab_size, args.tie_embeddings)
        init_weights(self, args.init_std, args.n_prelude + args.n_layers * args.mean_recurrence + args.n_coda)
        if args.local_layers:  # Gemma 3's sliding-window layers
            args.local_layers.apply(self)

    # --- the network --------------------------------------------------------------------------

    def _stack(self, layers, x, cos, sin, caches=None, rows=None):
        recompute = self.args.activation_checkpointing and torch.is_grad_enabled() and not caches
        for i, layer in enumerate(layers):
            if recompute:  # model.activation_checkpointing: the iterations with gradient recompute each layer
                x = checkpoint(layer, x, cos, sin, None, rows, use_reentrant=False)
            else:
                x = layer(x, cos, sin, caches[i] if caches else None, rows)
        return x

    def initial_state(self, e: torch.Tensor, generator=None) -> torch.Tensor:
        # drawn in fp32 and cast, as the cached decode's: the same draws at every precision
        return (self.init_scale * torch.randn(e.shape, device=e.device, generator=generator)).to(e.dtype)

    def iterate(self, s, e, cos, sin, caches=None):
        """One recurrence: s <- core(adapter(cat[s, e]))."""
        return self._stack(self.core, self.adapter(torch.cat([s, e], dim=-1)), cos, sin, caches)

    def forward(self, idx, num_iterations: int, generator=None, no_grad_iterations: int = 0, s0=None):
        """idx (B, T) -> logits (B, T, V) after `num_iterations` core passes (the first
        `no_grad_iterations` of them without gradient: truncated backprop)."""
        cos, sin = self.rope(torch.arange(idx.shape[1], device=idx.device))
        e = self._stack(self.prelude, self.tok_emb(idx), cos, sin)
        s = self.initial_state(e, generator) if s0 is None else s0
        with torch.no_grad():
            for _ in range(no_grad_iterations):
                s = self.iterate(s, e, cos, sin)
        for _ in range(num_iterations - no_grad_iterations):
            s = self.iterate(s, e, cos, sin)
        h = self._stack(self.coda, s, cos, sin)
        return F.linear(self.norm(h), self.head_weight)

    # --- training -----------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)  # same r on every rank
        r = sample_recurrence(self.mean_recurrence, g)
        k = min(r, self.backprop_depth)
        logits = self(x, r, no_grad_iterations=r - k)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        return loss, {"recurrence": r}

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        g = torch.Generator(device=x.device).manual_seed(seed)
        logits = self(x, self.mean_recurrence, generator=g)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    @torch.no_grad()
    def score(self, x, y, settings, generator=None) -> dict:
        """Exact next-token NLL (B, T) for each K of the grid (resolved at the boundary). The iterations
        are shared: the state after K_1 iterations continues to K_2 > K_1."""
        ks = sorted(set(settings.k_grid))
        cos, sin = self.rope(torch.arange(x.shape[1], device=x.device))
        e = self._stack(self.prelude, self.tok_emb(x), cos, sin)
        s = self.initial_state(e, generator)
        out, done = {}, 0
        for K in ks:
            for _ in range(K - done):
                s = self.iterate(s, e, cos, sin)
            done = K
            logits = F.linear(self.norm(self._stack(self.coda, s, cos, sin)), self.head_weight)
            out[K] = TokenScores(token_cross_entropy(logits, y))
        return out

    @torch.no_grad()
    def token_logprobs(self, x, y, settings, num_iterations: int, generator=None) -> torch.Tensor:
        return self(x, num_iterations, generator=generator).float().log_softmax(-1)

    # --- generation: a KV cache per (iteration, layer) ------------------------------------------

    def iteration_limits(self) -> IterationLimits:
        return self.args.limits

    def new_cache(self, batch: int, max_len: int) -> "HuginnCache":
        return HuginnCache(self, batch, max_len)

    @torch.no_grad()
    def forward_cached(self, idx, caches: "HuginnCache", rows, batch: RowBatch, want_logits: bool = True) -> torch.Tensor:
        """New tokens idx (R, n) of `rows` -> logits (R, V) after the last. Rows with different K run
        in separate passes; a row's K must stay the same for its whole sequence (every iteration's cache
        needs every token). The random initial state is drawn per row (or taken from batch.noise)."""
        sel = caches.rows(rows)
        R, n = idx.shape
        d = self.tok_emb.weight.shape[1]
        noise = batch.noise if batch.noise is not None else \
            self.init_scale * batch.random.normal(torch.arange(R), (n, d), idx.device)
        out = None
        by_k: dict[int, list[int]] = {}
        for i, s in enumerate(batch.settings):
            by_k.setdefault(s.num_iterations, []).append(i)
        for K, members in by_k.items():
            idx_k = torch.tensor(members, device=idx.device)
            every = len(members) == R
            logits = self._decode(idx if every else idx[idx_k], caches, sel if every else sel[idx_k], K,
                                  noise if every else noise[idx_k], want_logits)
            if every:
                return logits
            if logits is None:  # a prompt chunk that is not the last: the caches only
                continue
            out = logits.new_empty(R, logits.shape[-1]) if out is None else out
            out[idx_k] = logits
        return out

    def _decode(self, idx, caches: "HuginnCache", sel, K: int, noise, want_logits: bool = True):
        for i, it in enumerate(caches.iterations(K)):
            if not torch.equal(it[0].lengths[sel], caches.lengths[sel]):
                raise UserError(f"num_iterations changed within a sequence (iteration {i + 1} of {K} has "
                                f"not seen its earlier tokens)", "num_iterations")
        positions = positions_after(caches.lengths, sel, idx.shape[1], idx.device)
        caches.lengths[sel] += idx.shape[1]
        cos, sin = self.rope(positions)
        e = self._stack(self.prelude, self.tok_emb(idx), cos, sin, caches.prelude, sel)
        s = noise.to(e.dtype)  # drawn in fp32 (the same draws at every precision)
        for it in caches.iterations(K):
            s = self._stack(self.core, self.adapter(torch.cat([s, e], dim=-1)), cos, sin, it, sel)
        h = self._stack(self.coda, s, cos, sin, caches.coda, sel)
        return self.head_t.product(self.norm(h[:, -1]), self.head_weight) if want_logits else None

    def reset_rows(self, caches: "HuginnCache", rows) -> None:
        caches.reset(rows)

    def reserve(self, caches: "HuginnCache", max_iterations: int | None) -> None:
        if max_iterations:
            caches.iterations(max_iterations)  # one cache per iteration: allocate every K served


class HuginnCache:
    """KV caches of the prelude, of every (iteration, core layer) and of the coda, for a batch of
    rows. Iteration caches are made on first use: their number is the largest K asked so far."""

    def __init__(self, model: HuginnLM, batch: int, max_len: int):
        p = model.tok_emb.weight
        self._make = lambda n: [KVCache(batch, model.n_heads, max_len, model.head_dim, p.device,
                                        p.dtype) for _ in range(n)]
        self.n_core = len(model.core)
        self.prelude, self.coda, self.core = self._make(len(model.prelude)), self._make(len(model.coda)), []
        self.lengths = torch.zeros(batch, dtype=torch.long, device=p.device)

    def rows(self, rows):
        return torch.arange(self.lengths.shape[0], device=self.lengths.device) if rows is None else rows

    def iterations(self, K: int) -> list[list[KVCache]]:
        while len(self.core) < K:
            self.core.append(self._make(self.n_core))
        return self.core[:K]

    def reset(self, rows) -> None:
        self.lengths[self.rows(rows)] = 0
        for cache in self.prelude + self.coda + [c for it in self.core for c in it]:
            cache.reset(rows)

    def nbytes_per_token(self) -> int:
        every = self.prelude + self.coda + [c for it in self.core for c in it]
        return sum(c.nbytes_per_token() for c in every)


def build(args: HuginnArgs, state: dict | None = None) -> HuginnLM:
    return HuginnLM(args)

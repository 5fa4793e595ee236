"""Routed K-step decoding of the DiffusionBlocks LMs against clean-stream KV caches (method.md §5).

Per token: K Euler steps from pure noise, each routed to the block that owns sigma_k, each against
that block's cached clean stream. A block's cache only grows with tokens, never with K. `CachedDecoding`
is mixed into `DiffusionBlocksLM`; it relies on the model's `run_block`, `chain`, `window_call`,
`clean_inputs`, `layers_of` and `block_input`.
"""

from __future__ import annotations

import warnings

import torch

from looped_lm.errors import UserError
from looped_lm.models.layers import KVCache


class DecodeState:
    """Generation state of a batch of rows (sequences or serving slots): KV caches of the prelude and
    of every block's clean stream, and each row's history of clean inputs.

    Blocks run only when a denoising step routes to them, so each block's cache may lag behind the
    token history; it catches up (all pending tokens in one forward) the next time the block runs.
    """

    def __init__(self, model, batch: int, max_len: int):
        p = model.tok_emb.weight
        H, D = model.n_heads, p.shape[1] // model.n_heads

        def caches(n):
            return [KVCache(batch, H, max_len, D, p.device, p.dtype) for _ in range(n)]

        self.prelude = caches(len(model.prelude))
        self.blocks = [caches(len(model.layers_of(b))) for b in range(len(model.blocks))]
        self.clean_inputs = torch.zeros(batch, max_len, p.shape[1], device=p.device, dtype=p.dtype)
        # what each block's clean stream reads: the embeddings, or (context: stacked) block b-1's output
        self.block_inputs = [self.clean_inputs] + [
            torch.zeros_like(self.clean_inputs) if model.stacked else self.clean_inputs
            for _ in range(len(model.blocks) - 1)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=p.device)  # tokens in each row's history

    def rows(self, rows):
        return torch.arange(self.lengths.shape[0], device=self.lengths.device) if rows is None else rows

    def reset(self, rows) -> None:
        self.lengths[self.rows(rows)] = 0
        for cache in self.prelude + [c for block in self.blocks for c in block]:
            cache.reset(rows)

    def nbytes_per_token(self) -> int:
        """Cache bytes per token of history: every clean-stream K/V plus the stored clean inputs
        (one d-vector per block input buffer). None of it depends on K."""
        every = self.prelude + [c for block in self.blocks for c in block]
        inputs = {id(buf): buf for buf in self.block_inputs}.values()
        return sum(c.nbytes_per_token() for c in every) + sum(b.shape[-1] * b.element_size() for b in inputs)


class CachedDecoding:
    """Generation methods of DiffusionBlocksLM: the engine's and `generate`'s entry points."""

    def inference_kwargs(self, num_iterations: int | None, bridge: str | None, exit_rule=None) -> dict:
        K = num_iterations if num_iterations is not None else (self.cfg.diffusion.num_iterations or len(self.blocks))
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise UserError(f"num_iterations must be an integer >= 1 (got {K})")
        if K > self.max_iterations:
            raise UserError(f"num_iterations {K} exceeds model.max_iterations ({self.max_iterations})")
        if K < len(self.blocks):
            warnings.warn(f"num_iterations={K} < {len(self.blocks)} blocks: some blocks are skipped", stacklevel=2)
        kw = {"num_iterations": K, "bridge": bridge or self.cfg.diffusion.bridge}
        if exit_rule is not None:
            kw["exit_rule"] = exit_rule
        return kw

    def new_cache(self, batch: int, max_len: int) -> DecodeState:
        return DecodeState(self, batch, max_len)

    def forward_cached(self, idx, state: DecodeState, num_iterations: int | None = None, bridge: str = "hard",
                       generator=None, noise=None, exit_rule=None, stats=None, rows=None, sampling=None):
        """Append tokens idx (R, n) to the history of `rows` (default all); return logits (R, 1, V)
        for each row's next token, after K routed denoising steps. `noise` (R, 1, d): the starting z
        (default: drawn from `generator`, see `initial_noise`). `sampling`: the SamplingParams the
        `sample` bridge draws with."""
        K = num_iterations or len(self.blocks)
        R, n = idx.shape
        sel = state.rows(rows)
        start = state.lengths[sel]
        emb = self.clean_inputs(idx, state.prelude, rows)
        state.clean_inputs[sel[:, None], start[:, None] + torch.arange(n, device=idx.device)] = emb
        ends = start + n
        state.lengths[sel] = ends
        aligned = bool((ends == ends[0]).all())
        noisy_pos = ends[:1] if aligned else ends[:, None]  # the next token's position, per row
        prev = idx[:, -1:]  # the token before each row's next one

        def call(b, z_, sigma):
            if self.stacked:  # blocks < b feed this block's clean stream: bring them up to date first
                for prior in range(b):
                    self.catch_up(prior, state, sel)
            caches = state.blocks[b]
            cached = caches[0].lengths[sel]
            pending = ends - cached
            if not bool((pending == pending[0]).all()):  # ragged: rows skipped this block for different spans
                self.catch_up(b, state, sel)
                return self.run_block(b, None, z_, sigma, noisy_pos, None, caches, rows, prev)
            # common case: the pending tokens join the noisy slot's forward
            span = cached[:, None] + torch.arange(int(pending[0]), device=idx.device)
            clean = state.block_inputs[b][sel[:, None], span]
            if not (self.stacked and b + 1 < len(self.blocks)) or span.shape[1] == 0:
                return self.run_block(b, clean, z_, sigma, noisy_pos, None, caches, rows, prev)
            logits, out = self.run_block(b, clean, z_, sigma, noisy_pos, None, caches, rows, prev, return_clean=True)
            state.block_inputs[b + 1][sel[:, None], span] = out
            return logits

        return self.chain(call, K, (R, 1), idx.device, generator, bridge, noise, exit_rule, stats, sampling)

    def initial_noise(self, batch: int, n: int, generator=None, device=None) -> torch.Tensor:
        """z ~ N(0, sigma_top^2 I) of shape (batch, n, d): what a chain starts from, drawn as `chain` does."""
        d = self.tok_emb.weight.shape[1]
        return self.sigma_top() * torch.randn(batch, n, d, device=device, generator=generator)

    def reset_rows(self, state: DecodeState, rows) -> None:
        state.reset(rows)

    @torch.no_grad()
    def prompt_logits(self, idx, num_iterations: int | None = None, bridge: str | None = None, generator=None,
                      **_):
        """Logits (B, T, V) at every position of idx (position t predicts t+1), each from its own
        K-step chain, all positions in parallel: the prompt log-probs of `echo`."""
        K = num_iterations or len(self.blocks)
        B, T = idx.shape
        return self.chain(self.window_call(idx), K, (B, T), idx.device, generator, bridge or self.cfg.diffusion.bridge)

    @torch.no_grad()
    def next_logits_uncached(self, idx, num_iterations: int, bridge: str, z):
        """Reference for tests: the same K-step chain for the token after idx (B, P), no cache."""
        clean = self.clean_inputs(idx)
        pos = torch.tensor([idx.shape[1]], device=idx.device)

        def call(b, z_, sigma):
            return self.run_block(b, self.block_input(clean, b), z_, sigma, pos, None, prev=idx[:, -1:])

        return self.chain(call, num_iterations, (idx.shape[0], 1), idx.device, None, bridge, z)

    def catch_up(self, b, state: "DecodeState", sel: torch.Tensor) -> None:
        """Bring block b's clean-stream cache of the rows `sel` up to their histories, one row at a time
        (rows may lag by different spans); with context: stacked, also record the block's output."""
        layers, caches = self.layers_of(b), state.blocks[b]
        feeds_next = self.stacked and b + 1 < len(self.blocks)
        for r in sel.tolist():
            start, end = int(caches[0].lengths[r]), int(state.lengths[r])
            if start == end:
                continue
            clean = state.block_inputs[b][r:r + 1, start:end]
            cos, sin = self.rope(torch.arange(start, end, device=clean.device))
            row = torch.tensor([r], device=clean.device)
            for i, layer in enumerate(layers):
                clean, _, _ = layer.clean(clean, cos, sin, caches[i], row, need_output=feeds_next or i + 1 < len(layers))
            if feeds_next:
                state.block_inputs[b + 1][r, start:end] = clean[0]


NOISE_STRIDE = 1_000_003


def positional_noise(seed: int, positions: torch.Tensor, d: int, scale: float) -> torch.Tensor:
    """(N, d): z for the token after each position, scale * N(0, I) from generator (seed, position).
    Batch-independent noise: what the vLLM backend draws (its forward sees positions, not requests);
    pass it as `forward_cached(noise=...)` to reproduce its tokens natively."""
    rows = [torch.randn(d, generator=torch.Generator().manual_seed(seed * NOISE_STRIDE + int(p)))
            for p in positions.tolist()]
    return scale * torch.stack(rows) if rows else torch.zeros(0, d)


def positional_gumbel(seed: int, positions: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """(N, V) Gumbel noise for the sample bridge's draw at `step`, from generator (seed, position, step)."""
    rows = []
    for p in positions.tolist():
        g = torch.Generator().manual_seed((seed * NOISE_STRIDE + int(p)) * 131 + step + 1)
        rows.append(-torch.log(-torch.log(torch.rand(vocab, generator=g).clamp_min(1e-20))))
    return torch.stack(rows) if rows else torch.zeros(0, vocab)

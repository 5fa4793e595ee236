"""Where a chain's denoising calls get their context: a whole window (scoring), or KV caches (decoding).

Both give the chain (`looped_lm/diffusion/chain.py`) and the estimator the same callable,
`denoise(block, z, sigma, rows) -> logits`, so the K-step chain is written once. Both run the clean
stream through `DBNetwork.clean_kv` and the slots through `DBNetwork.noisy_pass`.

    WindowContext   every slot of a window (B, T) at once; each block's clean K/V computed on first use
    DecodeState     per-row KV caches of the prelude and of every block's clean stream, for generation
    CachedContext   the next token of some rows of a DecodeState

With `context: stacked` a block's clean input is the states its feeder (`DBNetwork.feeder`) hands on, so
a block that runs first brings its feeder up to date (recursively): every block still computes each
token's clean states once, whatever K skips. With `noisy_input: clean_state` a slot also reads its block's
clean input at the slot's previous token: the window's `_input(b)` at the slot, or the decode state's
stored input (`DecodeState.inputs(b)`) at the row's last token.
"""

from __future__ import annotations

import torch

from looped_lm.models.layers import FixedShapeRows, KVCache
from looped_lm.models.two_stream import slot_mask


def _select(t: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Rows of t (its batch dimension), as a view when `rows` is every row in order."""
    if rows.shape[0] == total and bool((rows == torch.arange(total, device=rows.device)).all()):
        return t
    return t.index_select(0, rows)


class WindowContext:
    """Scores every slot of the window x (B, T): slot t predicts the token after x[:, t]."""

    def __init__(self, net, x: torch.Tensor):
        self.net, self.x = net, x
        T = x.shape[1]
        self.slots = torch.arange(T, device=x.device)
        self.mask = slot_mask(self.slots, T, net.noisy_self, full_window=True)
        self.clean = net.clean_inputs(x)
        self.inputs: dict[int, torch.Tensor] = {}  # context stacked: block b's clean input, its feeder's states
        self.kv: dict[int, list] = {}

    def _input(self, b: int) -> torch.Tensor:
        feeder = self.net.feeder(b)
        if feeder is None:
            return self.clean
        if b not in self.inputs:
            self._encode(feeder)
        return self.inputs[b]

    def _encode(self, b: int) -> None:
        """Block b's clean K/V, and (stacked) what it hands to the next block: each block runs once."""
        fed = self.net.fed(b)
        self.kv[b], handed = self.net.clean_pass(b, self._input(b), self.slots, hand_on=fed is not None)
        if fed is not None:
            self.inputs[fed] = handed

    def denoise(self, b: int, z, sigma, rows: torch.Tensor | None = None):
        return self._denoise(b, z, sigma, rows, self.slots, self.mask)

    def _denoise(self, b: int, z, sigma, rows, slots: torch.Tensor, mask):
        if b not in self.kv:
            self._encode(b)
        B = self.x.shape[0]
        kv, prev = self.kv[b], self.x[:, slots] if slots is not self.slots else self.x
        clean = None
        if self.net.clean_state:  # noisy_input clean_state: block b's clean input at the slot's previous token
            clean = self._input(b)
            clean = clean[:, slots] if slots is not self.slots else clean
        if rows is not None:  # a subset, or repeated rows (the estimator's branches)
            kv = [(_select(k, rows, B), _select(v, rows, B)) for k, v in kv]
            prev = _select(prev, rows, B)
            clean = _select(clean, rows, B) if clean is not None else None
        return self.net.noisy_pass(b, z, sigma, prev, slots + 1, kv, mask, clean=clean)

    def at(self, slots: torch.Tensor) -> "SlotSubset":
        """The same window, scoring only `slots` (ascending): the same clean K/V, fewer noisy slots."""
        return SlotSubset(self, slots)


class SlotSubset:
    """Some slots of a WindowContext (the estimator's extra draws for the tokens still unresolved): a slot's
    logits do not depend on which other slots run, since a noisy slot sees clean keys and itself only."""

    def __init__(self, window: WindowContext, slots: torch.Tensor):
        self.window, self.slots = window, slots
        T = window.x.shape[1]
        self.mask = slot_mask(slots, T, window.net.noisy_self, full_window=slots.shape[0] == T)  # ascending, distinct

    def denoise(self, b: int, z, sigma, rows: torch.Tensor | None = None):
        return self.window._denoise(b, z, sigma, rows, self.slots, self.mask)


class DecodeState:
    """Generation state of a batch of rows (sequences or serving slots): KV caches of the prelude and
    of every block's clean stream, each row's history of clean inputs, and its last token.

    Blocks run only when a denoising step routes to them, so a block's cache may lag behind the history
    (K < B skips blocks); it catches up, all pending tokens in one forward, the next time it runs.
    None of it depends on K.
    """

    def __init__(self, net, batch: int, max_len: int):
        p = net.tok_emb.weight
        H, D = net.n_heads, net.head_dim

        def caches(n):
            return [KVCache(batch, H, max_len, D, p.device, p.dtype) for _ in range(n)]

        self.prelude = caches(len(net.prelude))
        self.blocks = [caches(len(net.layers_of(b))) for b in range(len(net.blocks))]
        self.history = torch.zeros(batch, max_len, p.shape[1], device=p.device, dtype=p.dtype)
        # context stacked: block b's clean input is its feeder's clean states, kept once computed
        self.handed = {b: torch.zeros_like(self.history) for b in range(len(net.blocks)) if net.feeder(b) is not None}
        self.lengths = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.last = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.block_step = None  # a compiled `block_fixed` the engine installs (FixedShapeBlocks.use_block_step)
        self.frozen_tables: list[torch.Tensor] = []  # the inference tables it reads (use_block_step)

    def rows(self, rows):
        return torch.arange(self.lengths.shape[0], device=self.lengths.device) if rows is None else rows

    def reset(self, rows) -> None:
        self.lengths[self.rows(rows)] = 0
        for cache in self.prelude + [c for block in self.blocks for c in block]:
            cache.reset(rows)

    def nbytes_per_token(self) -> int:
        """Bytes per token of history: every clean-stream K/V plus the stored clean input."""
        every = self.prelude + [c for block in self.blocks for c in block]
        inputs = (1 + len(self.handed)) * self.history.shape[-1] * self.history.element_size()
        return sum(c.nbytes_per_token() for c in every) + inputs

    def inputs(self, b: int) -> torch.Tensor:
        """Block b's clean inputs, by row and position: the shared history, or (stacked) its feeder's states."""
        return self.handed.get(b, self.history)

    def append(self, net, idx: torch.Tensor, rows) -> torch.Tensor:
        """Add tokens idx (R, n) to the histories of `rows` (through the prelude); -> the selected rows."""
        sel = self.rows(rows)
        start = self.lengths[sel]
        n = idx.shape[1]
        if n:
            emb = net.clean_inputs(idx, self.prelude, rows)
            self.history[sel[:, None], start[:, None] + torch.arange(n, device=idx.device)] = emb
            self.lengths[sel] = start + n
            self.last[sel] = idx[:, -1]
        return sel


class CachedContext:
    """The next token of the rows `sel` of a DecodeState. `rows` passed to `denoise` index into sel
    (and may repeat: the estimator's branches); pending clean tokens are appended on a block's first call."""

    def __init__(self, net, state: DecodeState, sel: torch.Tensor):
        self.net, self.state, self.sel = net, state, sel
        ends = state.lengths[sel]
        self.noisy_pos = ends[:, None]  # the next token's position, per row

    def _all(self, rows: torch.Tensor) -> bool:
        return rows.shape[0] == self.sel.shape[0] and bool((rows == torch.arange(len(rows), device=rows.device)).all())

    def _fused(self, b: int, z, sigma):
        """The common decode step: every row has the same number of pending clean tokens for block b;
        they and the noisy slots go through the block in one weight pass. None when not applicable."""
        caches = self.state.blocks[b]
        start, ends = caches[0].lengths[self.sel], self.state.lengths[self.sel]
        pending = ends - start
        n = int(pending[0])
        if n == 0 or not bool((pending == n).all()):
            return None
        span = start[:, None] + torch.arange(n, device=start.device)
        aligned = bool((start == start[0]).all())
        clean_pos = span[0] if aligned else span
        noisy_pos = ends[:1] if aligned else ends[:, None]
        clean = self.state.inputs(b)[self.sel[:, None], span]
        prev = self.state.last[self.sel][:, None]
        logits, handed = self.net.fused_pass(b, clean, clean_pos, caches, self.sel, z, sigma, prev, noisy_pos,
                                             hand_on=self._hands_on(b), slot_clean=self._slot_clean(b, self.sel))
        if handed is not None:
            self.state.handed[self.net.fed(b)][self.sel[:, None], span] = handed
        return logits

    def _slot_clean(self, b: int, sel: torch.Tensor):
        """noisy_input clean_state: block b's clean input state at each row's last token (R, 1, C): the shared
        history, or (stacked) the states its feeder handed on, which `denoise` brought up to date first;
        None for the other noisy inputs."""
        if not self.net.clean_state:
            return None
        last = (self.state.lengths[sel] - 1).clamp_min(0)
        return self.state.inputs(b)[sel, last][:, None]

    def _hands_on(self, b: int) -> bool:
        return self.net.fed(b) is not None

    def catch_up(self, b: int) -> None:
        """Bring block b's cache of every row in sel up to its history: aligned rows in one forward,
        ragged ones (they skipped this block for different spans) one row at a time."""
        net, state, caches = self.net, self.state, self.state.blocks[b]
        if net.feeder(b) is not None:  # block b's inputs are its feeder's states: bring it up to date first
            self.catch_up(net.feeder(b))
        cached, ends = caches[0].lengths[self.sel], state.lengths[self.sel]
        pending = ends - cached
        if not bool(pending.any()):
            return
        groups = [self.sel] if bool((pending == pending[0]).all()) else [r[None] for r in self.sel]
        for rows in groups:
            start, n = caches[0].lengths[rows], int((state.lengths[rows] - caches[0].lengths[rows])[0])
            if n == 0:
                continue
            span = start[:, None] + torch.arange(n, device=start.device)
            positions = span[0] if bool((start == start[0]).all()) else span
            _, handed = net.clean_pass(b, state.inputs(b)[rows[:, None], span], positions, caches, rows,
                                       hand_on=self._hands_on(b))
            if handed is not None:
                state.handed[net.fed(b)][rows[:, None], span] = handed

    def block_fixed(self, b: int, z, sigma, append: bool):
        """Block b's call for every row of sel with static shapes and no host reads (what the engine compiles):
        with `append`, each row's one pending token and its slot in one pass (`_fused`), else the slot against
        the cache (`denoise`'s noisy pass); every cache read over its whole length, masked by its lengths."""
        state, sel, net = self.state, self.sel, self.net
        ends = state.lengths[sel]
        last = ends - 1  # the row's last token: the pending one with `append`
        inputs = state.inputs(b)[sel, last][:, None]
        slot_clean = inputs if net.clean_state else None
        prev = state.last[sel][:, None]
        caches = [FixedShapeRows(c) for c in state.blocks[b]]
        if append:
            logits, handed = net.fused_pass(b, inputs, last[:, None], caches, sel, z, sigma, prev, ends[:, None],
                                            hand_on=self._hands_on(b), slot_clean=slot_clean)
            if handed is not None:
                state.handed[net.fed(b)][sel, last] = handed[:, 0]
            return logits
        kv, valid = [], None
        for cache in caches:
            k, v, valid = cache.view(sel)
            kv.append((k, v))
        mask = torch.cat([valid, valid.new_ones(*valid.shape[:-1], 1)], -1) if net.noisy_self else valid
        return net.noisy_pass(b, z, sigma, prev, ends[:, None], kv, mask, clean=slot_clean)

    def _compiled(self, b: int, z, sigma):
        """The engine's compiled `block_fixed` where it applies (every row has 0 or 1 pending tokens for block
        b, the same count): every decode step of a request whose blocks run at each token. Else None."""
        pending = self.state.lengths[self.sel] - self.state.blocks[b][0].lengths[self.sel]
        n = int(pending[0])
        if n > 1 or not bool((pending == n).all()):
            return None
        return self.state.block_step(b, self.state, self.sel, z, sigma, n == 1)

    def denoise(self, b: int, z, sigma, rows: torch.Tensor | None = None):
        if self.net.feeder(b) is not None:
            self.catch_up(self.net.feeder(b))
        if self.state.block_step is not None and z.shape[1] == 1 and (rows is None or self._all(rows)):
            compiled = self._compiled(b, z, sigma)
            if compiled is not None:
                return compiled
        if rows is None or self._all(rows):
            fused = self._fused(b, z, sigma)
            if fused is not None:
                return fused
        self.catch_up(b)
        sel = self.sel if rows is None else self.sel[rows]
        caches = self.state.blocks[b]
        kv, valid = [], None
        for cache in caches:
            k, v, valid = cache.view(sel)
            kv.append((k, v))
        mask = valid
        if self.net.noisy_self:  # the slot's own key after the clean ones
            if valid is None:
                valid = torch.ones(len(sel), 1, 1, kv[0][0].shape[2], dtype=torch.bool, device=z.device)
            mask = torch.cat([valid, valid.new_ones(*valid.shape[:-1], 1)], -1)
        pos = self.state.lengths[sel][:, None]
        noisy_pos = pos[:1, 0] if bool((pos == pos[0]).all()) else pos
        prev = self.state.last[sel][:, None]
        return self.net.noisy_pass(b, z, sigma, prev, noisy_pos, kv, mask, clean=self._slot_clean(b, sel))

"""The engine's compiled decode steps: gpt's `FixedShapeDecoding.decode_fixed` (a whole step), and the DB kinds'
`FixedShapeBlocks.decode_block_fixed` (each block call of the K-step chain: the chain's control, its bridges
and per-row draws stay eager), through torch.compile.

A decode step's shapes depend on how many rows run, so the rows are padded to a few bucket sizes (powers of
two up to the slot count; the padding repeats the last row with its own token, which writes the same key and
value again), with the row count marked dynamic: two graphs (one row, and any other count), none per step or
per position, since the step attends over the cache's whole length under a mask. On a GPU each bucket is
captured as a CUDA graph (torch.compile's "reduce-overhead" mode, the cache tensors marked as static
addresses); on a CPU inductor compiles the graphs to C++. Prefill (several tokens per row) stays eager: its shapes change with every prompt.
"""

from __future__ import annotations

import torch

from looped_lm import devices
from looped_lm.compile import compile_graphs
from looped_lm.models.contract import FixedShapeBlocks, FixedShapeDecoding

BACKEND = "inductor"  # torch.compile's default; tests swap in a counting backend


def buckets(num_slots: int) -> list[int]:
    """Row counts a compiled step runs at: 1, 2, 4, ... and the slot count itself."""
    sizes, n = [], 1
    while n < num_slots:
        sizes.append(n)
        n *= 2
    return sizes + [num_slots]


def compile_setting(setting: str, device: torch.device) -> bool:
    """--compile-decode: "on", "off", or "auto" (devices.compile_enabled: on for CUDA; off on CPU, where each
    bucket's first step waits tens of seconds for the C++ compiler)."""
    return devices.compile_enabled(setting, device.type)


class _Bucketed:
    """`fn` compiled with room for `graphs_per_bucket` graphs per bucket; calls padded to the buckets."""

    def __init__(self, fn, model, pool, num_slots: int, graphs_per_bucket: int, backend: str | None):
        backend = backend or BACKEND
        self.model, self.pool, self.buckets = model, pool, buckets(num_slots)
        self.device = next(model.parameters()).device
        self.cuda_graphs = devices.uses_cuda_graphs(self.device.type, backend)
        if self.cuda_graphs:  # CUDA graphs replay fixed addresses: the pool's tensors must not be copied in per call
            for t in _tensors(pool):
                torch._dynamo.mark_static_address(t)
        # fullgraph: a graph break would be a silent fall back to eager for part of every step; isolated, with
        # room for its graphs: every engine in a process compiles the same method, and a shared count would
        # make a later engine's steps fail past dynamo's default limit of 8
        self.step = compile_graphs(fn, graphs_per_bucket * min(2, len(self.buckets)), backend, fullgraph=True,
                                   mode=devices.decode_compile_mode(self.device.type, backend))

    def padded(self, rows: torch.Tensor, *per_row: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
        """(R, the tensors padded to the smallest bucket that holds R rows, by repeating the last row), their row
        count marked dynamic: one graph serves every bucket above 1 (dynamo specialises a size of 1), and on a
        GPU each bucket is captured as a CUDA graph of its own from it (the compile is the slow part)."""
        R = rows.shape[0]
        pad = next(b for b in self.buckets if b >= R) - R
        out = [t if not pad else torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) for t in (rows, *per_row)]
        for t in out:
            torch._dynamo.mark_dynamic(t, 0)
        return R, out

    def output(self, out: torch.Tensor, R: int) -> torch.Tensor:
        return out[:R].clone() if self.cuda_graphs else out[:R]  # a CUDA graph's output is overwritten by its next replay


class CompiledDecode(_Bucketed):
    """gpt: the whole one-token step (two graphs: one row, and any other bucket)."""

    def __init__(self, model: FixedShapeDecoding, pool, num_slots: int, backend: str | None = None):
        super().__init__(model.decode_fixed, model, pool, num_slots, 1, backend)

    @torch.no_grad()  # as the engine's steps run: grad mode is part of what a graph is guarded on
    def warm_up(self) -> None:
        """Compile and run every bucket now (twice on CUDA: reduce-overhead records a bucket's CUDA graph on its
        second call), on the empty pool (then emptied again), so no request waits for one."""
        for size in self.buckets:
            for _ in range(2 if self.cuda_graphs else 1):
                _, (rows, ids) = self.padded(torch.arange(size, device=self.device),
                                             torch.zeros(size, 1, dtype=torch.long, device=self.device))
                self.step(ids, self.pool, rows)
                self.model.reset_rows(self.pool, rows)

    def __call__(self, ids: torch.Tensor, pool, rows: torch.Tensor) -> torch.Tensor:
        """ids (R, 1) of `rows` (R,) -> logits (R, V), run at the smallest bucket that holds R rows."""
        R, (rows, ids) = self.padded(rows, ids)
        return self.output(self.step(ids, pool, rows), R)


class CompiledBlocks(_Bucketed):
    """db_ar / looped_db: graphs per block and per kind of call (with the pending token, or a
    block's second call at the same token); installed in the pool, where the model's chain finds it."""

    def __init__(self, model: FixedShapeBlocks, pool, num_slots: int, num_blocks: int, backend: str | None = None):
        model.use_block_step(pool, self)  # first: the tables it freezes into the pool are marked static with it
        super().__init__(model.decode_block_fixed, model, pool, num_slots, 2 * num_blocks, backend)
        self.num_blocks = num_blocks

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile every (block, call) and run every bucket now (twice on CUDA: reduce-overhead records a bucket's
        CUDA graph on its second call), on the empty pool, emptied again after: the calls read and write
        garbage there, which the lengths mask."""
        for size in self.buckets:
            rows = torch.arange(size, device=self.device)
            for b in range(self.num_blocks):
                for append in (True, False):
                    for _ in range(2 if self.cuda_graphs else 1):
                        _, args = self.padded(rows, *self.model.example_slots(size, self.device))
                        self.step(b, self.pool, *args, append)
            self.model.reset_rows(self.pool, rows)

    def __call__(self, b: int, pool, rows: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor,
                 append: bool) -> torch.Tensor:
        """`decode_block_fixed` at the smallest bucket that holds the rows."""
        R, (rows, z, sigma) = self.padded(rows, z, sigma)
        return self.output(self.step(b, pool, rows, z, sigma, append), R)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a pool (lists, dicts, attributes; not what a callable holds)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if hasattr(obj, "__dict__") and not callable(obj):
        return [t for x in vars(obj).values() for t in _tensors(x)]
    return []

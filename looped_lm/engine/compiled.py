"""The engine's compiled decode step: `FixedShapeDecoding.decode_fixed` through torch.compile.

A decode step's shapes depend on how many rows run, so the rows are padded to a few bucket sizes (powers of
two up to the slot count; the padding repeats the last row with its own token, which writes the same key and
value again) and each bucket compiles once: a graph per bucket, none per step or per position, since the
step attends over the cache's whole length under a mask. On a GPU the graphs are captured as CUDA graphs
(torch.compile's "reduce-overhead" mode, the cache tensors marked as static addresses); on a CPU inductor
compiles them to C++. Prefill (several tokens per row) stays eager: its shapes change with every prompt.
"""

from __future__ import annotations

import torch

from looped_lm.compile import compile_graphs
from looped_lm.models.contract import FixedShapeDecoding

BACKEND = "inductor"  # torch.compile's default; tests swap in a counting backend


def buckets(num_slots: int) -> list[int]:
    """Row counts a compiled step runs at: 1, 2, 4, ... and the slot count itself."""
    sizes, n = [], 1
    while n < num_slots:
        sizes.append(n)
        n *= 2
    return sizes + [num_slots]


def compile_setting(setting: str, device: torch.device) -> bool:
    """--compile-decode: "on", "off", or "auto" (on for CUDA; off on CPU, where each bucket's first step
    waits tens of seconds for the C++ compiler)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


class CompiledDecode:
    def __init__(self, model: FixedShapeDecoding, pool, num_slots: int, backend: str | None = None):
        backend = backend or BACKEND
        self.model, self.pool, self.buckets = model, pool, buckets(num_slots)
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        if self.cuda:  # CUDA graphs replay fixed addresses: the pool's tensors must not be copied in per call
            for t in _tensors(pool):
                torch._dynamo.mark_static_address(t)
        # fullgraph: a graph break would be a silent fall back to eager for part of every step; isolated, with
        # room for one graph per bucket: every engine in a process compiles the same method, and a shared
        # count would make a later engine's steps fail past dynamo's default limit of 8
        self.step = compile_graphs(model.decode_fixed, len(self.buckets), backend, fullgraph=True,
                                   mode="reduce-overhead" if self.cuda and backend == "inductor" else None)

    @torch.no_grad()  # as the engine's steps run: grad mode is part of what a graph is guarded on
    def warm_up(self) -> None:
        """Compile every bucket now, on the empty pool (then emptied again), so no request waits for one."""
        for size in self.buckets:
            rows = torch.arange(size, device=self.device)
            self.step(torch.zeros(size, 1, dtype=torch.long, device=self.device), self.pool, rows)
            self.model.reset_rows(self.pool, rows)

    def __call__(self, ids: torch.Tensor, pool, rows: torch.Tensor) -> torch.Tensor:
        """ids (R, 1) of `rows` (R,) -> logits (R, V), run at the smallest bucket that holds R rows."""
        R = rows.shape[0]
        size = next(b for b in self.buckets if b >= R)
        if size > R:
            pad = size - R
            rows = torch.cat([rows, rows[-1:].expand(pad)])
            ids = torch.cat([ids, ids[-1:].expand(pad, -1)])
        logits = self.step(ids, pool, rows)[:R]
        return logits.clone() if self.cuda else logits  # a CUDA graph's output is overwritten by its next replay


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if hasattr(obj, "__dict__"):
        return [t for x in vars(obj).values() for t in _tensors(x)]
    return []

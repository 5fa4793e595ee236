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
        self.buckets = buckets(num_slots)
        cuda = next(model.parameters()).device.type == "cuda"
        if cuda:  # CUDA graphs replay fixed addresses: the pool's tensors must not be copied in per call
            for t in _tensors(pool):
                torch._dynamo.mark_static_address(t)
        self.cuda = cuda
        # one graph per bucket must fit dynamo's per-function limit, or the largest buckets would run eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(self.buckets) + 1)
        # fullgraph: a graph break would be a silent fall back to eager for part of every step
        self.step = torch.compile(model.decode_fixed, backend=backend, fullgraph=True, dynamic=False,
                                  mode="reduce-overhead" if cuda and backend == "inductor" else None)

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

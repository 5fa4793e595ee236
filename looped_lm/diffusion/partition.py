"""Splitting the noise range into blocks, widening for overlap, routing σ to a block (docs/method.md §2).

Conventions used everywhere in the project:
- `edges` is an ascending list of B+1 floats, edges[0] = σ_lo, edges[-1] = σ_hi.
- Block 0 owns the HIGHEST-σ interval (and the first layers); block B−1 owns the lowest.
  So block b owns [edges[B−1−b], edges[B−b]].
- Edge rule: a σ exactly on an inner edge belongs to the LOWER-σ block (the higher block index),
  i.e. block b owns the half-open interval (edges[B−1−b], edges[B−b]]. With a descending inference
  grid whose step k sits on edges[B−k] (K = B, equi-probability), step k then runs block k.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import Tensor

from looped_lm.diffusion.noise import NoiseSchedule, cdf_range, sigma_at_fraction
from looped_lm.errors import UserError

PARTITION_KINDS = ("equi_probability", "uniform")


def _check_num_blocks(num_blocks) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise UserError(f"diffusion.num_blocks must be an integer >= 1 (got {num_blocks!r})")


def check_edges(edges) -> list[float]:
    """Edges must be ≥ 2 finite, positive, strictly ascending numbers; returns them as floats.

    Edges also come from checkpoints and configs, so a bad list is a user error, not a crash.
    """
    edges = [float(e) for e in edges]
    ok = len(edges) >= 2 and all(math.isfinite(e) and e > 0 for e in edges)
    if not ok or any(a >= b for a, b in zip(edges, edges[1:])):
        raise UserError(f"diffusion edges must be >= 2 positive, strictly ascending numbers (got {edges})")
    return edges


def equi_probability_edges(num_blocks: int, sched: NoiseSchedule) -> list[float]:
    """Edges at equal quantiles of the truncated log-normal: each block gets the same share of
    training σ draws. Ascending, length B+1, ends exactly σ_min and σ_max."""
    sched.validate()
    _check_num_blocks(num_blocks)
    q_lo, q_hi = cdf_range(sched.sigma_min, sched.sigma_max, sched)
    inner = [sigma_at_fraction(b / num_blocks, q_lo, q_hi, sched) for b in range(1, num_blocks)]
    return [float(sched.sigma_min), *inner, float(sched.sigma_max)]


def uniform_edges(num_blocks: int, sched: NoiseSchedule) -> list[float]:
    """Edges at equal widths in ln σ (the ablation option). Ascending, length B+1."""
    sched.validate()
    _check_num_blocks(num_blocks)
    ln_lo, ln_hi = math.log(sched.sigma_min), math.log(sched.sigma_max)
    inner = [math.exp(ln_lo + b / num_blocks * (ln_hi - ln_lo)) for b in range(1, num_blocks)]
    return [float(sched.sigma_min), *inner, float(sched.sigma_max)]


def make_edges(kind: str, num_blocks: int, sched: NoiseSchedule) -> list[float]:
    """Edges for a `diffusion.partition` that depends on the config alone.

    (`equi_entropy` needs a measured CE(σ) curve and is built by the code that measures it.)
    """
    if kind == "equi_probability":
        return equi_probability_edges(num_blocks, sched)
    if kind == "uniform":
        return uniform_edges(num_blocks, sched)
    raise UserError(f"diffusion.partition must be one of {', '.join(PARTITION_KINDS)} (got {kind!r})")


def block_intervals(edges) -> list[tuple[float, float]]:
    """Un-widened (lo, hi) per block index; block 0 is the highest-σ interval."""
    edges = check_edges(edges)
    num_blocks = len(edges) - 1
    return [(edges[num_blocks - 1 - b], edges[num_blocks - b]) for b in range(num_blocks)]


def widen(edges, overlap: float) -> list[tuple[float, float]]:
    """Training intervals per block index: each un-widened interval grown by
    overlap·(ln hi − ln lo) on both sides in ln σ, clipped to [edges[0], edges[-1]].

    The overlap lets neighbouring blocks both see σ near their shared edge, so the hand-over
    at inference is not a hard cliff.
    """
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 0.5:
        raise UserError(f"diffusion.overlap must be in [0, 0.5] (got {overlap!r})")
    intervals = block_intervals(edges)
    floor, ceil = intervals[-1][0], intervals[0][1]
    widened = []
    for lo, hi in intervals:
        pad = overlap * (math.log(hi) - math.log(lo))  # in ln σ; exp(±0) = 1 keeps γ = 0 exact
        widened.append((max(floor, lo * math.exp(-pad)), min(ceil, hi * math.exp(pad))))
    return widened


def route_sigma(sigma, edges):
    """Index of the block that owns σ at inference (un-widened edges).

    Rule: block = number of inner edges ≥ σ. So σ on an inner edge goes to the lower-σ block,
    σ ≥ edges[-1] (or above it) goes to block 0, σ ≤ the lowest inner edge to block B−1.
    Float in → int; Tensor in → LongTensor of the same shape (compared in σ's own dtype, so a
    float32 σ that is float32(edge) counts as on the edge).
    """
    inner = check_edges(edges)[1:-1]
    if isinstance(sigma, Tensor):
        if not sigma.is_floating_point():
            sigma = sigma.to(torch.float64)
        inner_t = torch.tensor(inner, dtype=sigma.dtype, device=sigma.device)  # [B-1] ascending
        return (inner_t >= sigma.unsqueeze(-1)).sum(-1)  # [...] int64
    # bisect_left counts the inner edges strictly below σ; the rest are ≥ σ.
    return len(inner) - bisect.bisect_left(inner, float(sigma))

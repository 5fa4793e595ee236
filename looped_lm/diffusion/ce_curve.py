"""Data-driven noise placement from a measured held-out CE(sigma) curve (method.md §8).

The curve is CE of the model's prediction at noise sigma, on held-out tokens, over a log-spaced
sigma grid. It is ~0 where the token can be read from z alone (low sigma) and flat at the top where
z carries nothing (high sigma); the useful work of the denoiser is the drop in between. From it:
  equi_entropy_edges     block edges at equal shares of that drop, between sigma_lo and sigma_hi
  block_shares           each block's share of the drop (block_sampling: loss_share)
  sample_sigma_from_curve  sigma with density proportional to dCE/dln(sigma) (noise: adaptive)
All pure functions of floats; the model measures the curve, the trainer decides when.
"""

from __future__ import annotations

import bisect
import math

import torch

from looped_lm.diffusion.noise import NoiseSchedule


def sigma_grid(sched: NoiseSchedule, n: int = 24) -> list[float]:
    """n sigmas, log-spaced over [sigma_min, sigma_max], ascending."""
    lo, hi = math.log(sched.sigma_min), math.log(sched.sigma_max)
    return [math.exp(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def monotone(ce: list[float]) -> list[float]:
    """Running maximum over ascending sigma: CE cannot fall as noise grows (measurement noise aside)."""
    out, top = [], -math.inf
    for c in ce:
        top = max(top, c)
        out.append(top)
    return out


def _sigma_at_level(sigmas: list[float], ce: list[float], level: float) -> float:
    """The sigma where the (monotone) curve first reaches `level`, linear in ln(sigma)."""
    i = bisect.bisect_left(ce, level)
    if i <= 0:
        return sigmas[0]
    if i >= len(ce):
        return sigmas[-1]
    c0, c1 = ce[i - 1], ce[i]
    t = 0.0 if c1 == c0 else (level - c0) / (c1 - c0)
    return math.exp(math.log(sigmas[i - 1]) + t * (math.log(sigmas[i]) - math.log(sigmas[i - 1])))


def _ce_at_sigma(sigmas: list[float], ce: list[float], sigma: float) -> float:
    """The curve at any sigma, linear in ln(sigma), clamped at the grid ends."""
    if sigma <= sigmas[0]:
        return ce[0]
    if sigma >= sigmas[-1]:
        return ce[-1]
    i = bisect.bisect_right(sigmas, sigma)
    t = (math.log(sigma) - math.log(sigmas[i - 1])) / (math.log(sigmas[i]) - math.log(sigmas[i - 1]))
    return ce[i - 1] + t * (ce[i] - ce[i - 1])


def equi_entropy_edges(sigmas: list[float], ce: list[float], num_blocks: int, plateau: float = 0.99) -> list[float]:
    """B+1 ascending edges: sigma_lo, the inner edges at equal shares of the CE drop, sigma_hi.

    sigma_hi is where the curve reaches `plateau` of its full drop (the top of the plateau); sigma_lo is
    where it is still within 1 - plateau of its floor (the token is readable from z below it).
    Returns None when the curve has no drop to share (an untrained model).
    """
    c = monotone(ce)
    floor, top = c[0], c[-1]
    drop = top - floor
    if drop <= 1e-6:
        return None
    lo = _sigma_at_level(sigmas, c, floor + (1 - plateau) * drop)
    hi = _sigma_at_level(sigmas, c, floor + plateau * drop)
    c_lo, c_hi = _ce_at_sigma(sigmas, c, lo), _ce_at_sigma(sigmas, c, hi)
    inner = [_sigma_at_level(sigmas, c, c_lo + (c_hi - c_lo) * b / num_blocks) for b in range(1, num_blocks)]
    edges = [lo, *inner, hi]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        return None  # a flat stretch collapsed two edges: keep the previous partition
    return edges


def block_shares(edges: list[float], sigmas: list[float], ce: list[float]) -> list[float]:
    """Each block's share of the CE drop across its interval, by block index (block 0 = highest sigma)."""
    c = monotone(ce)
    B = len(edges) - 1
    drops = [max(_ce_at_sigma(sigmas, c, edges[B - b]) - _ce_at_sigma(sigmas, c, edges[B - 1 - b]), 0.0)
             for b in range(B)]
    total = sum(drops)
    if total <= 1e-9:
        return [1.0 / B] * B
    return [d / total for d in drops]


def sample_sigma_from_curve(n: int, lo: float, hi: float, sigmas: list[float], ce: list[float],
                            generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """n sigmas in [lo, hi] with density proportional to dCE/dln(sigma): uniform in CE, mapped back.

    Falls back to log-uniform where the curve is flat over [lo, hi].
    """
    c = monotone(ce)
    c_lo, c_hi = _ce_at_sigma(sigmas, c, lo), _ce_at_sigma(sigmas, c, hi)
    u = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
    if c_hi - c_lo <= 1e-6:
        out = [math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))) for x in u]
    else:
        out = [min(max(_sigma_at_level(sigmas, c, c_lo + x * (c_hi - c_lo)), lo), hi) for x in u]
    return torch.tensor(out, dtype=torch.float32, device=device)

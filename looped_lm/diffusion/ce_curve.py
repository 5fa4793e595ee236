"""A measured held-out CE(sigma) curve and each block's share of it (docs/method.md §3).

The curve is CE of the model's prediction at noise sigma, on held-out tokens, over a log-spaced
sigma grid. It is ~0 where the token can be read from z alone (low sigma) and flat at the top where
z carries nothing (high sigma); the useful work of the denoiser is the drop in between.
`block_shares` gives each block its share of that drop: `block_sampling: loss_share` trains blocks in
that proportion. Part of the drop is free: the likelihood of z alone (the Bayes prediction from z
with no context, `ce_z`) falls as sigma falls whatever the network knows, and it falls most in the low
blocks. `gain_shares` counts only what the network adds beyond it, ce_z - ce, averaged over each
block's interval in ln sigma (`block_sampling: network_gain`): the context prior, which block 0 must
learn in full. Pure functions of floats; the model measures the curves, the trainer decides when.
"""

from __future__ import annotations

import bisect
import math

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


def _ce_at_sigma(sigmas: list[float], ce: list[float], sigma: float) -> float:
    """The curve at any sigma, linear in ln(sigma), clamped at the grid ends."""
    if sigma <= sigmas[0]:
        return ce[0]
    if sigma >= sigmas[-1]:
        return ce[-1]
    i = bisect.bisect_right(sigmas, sigma)
    t = (math.log(sigma) - math.log(sigmas[i - 1])) / (math.log(sigmas[i]) - math.log(sigmas[i - 1]))
    return ce[i - 1] + t * (ce[i] - ce[i - 1])


def block_shares(edges: list[float], sigmas: list[float], ce: list[float]) -> list[float]:
    """Each block's share of the CE drop across its interval, by block index (block 0 = highest sigma)."""
    c = monotone(ce)
    B = len(edges) - 1
    drops = [max(_ce_at_sigma(sigmas, c, edges[B - b]) - _ce_at_sigma(sigmas, c, edges[B - 1 - b]), 0.0)
             for b in range(B)]
    return _normalised(drops)


def gain_shares(edges: list[float], sigmas: list[float], ce: list[float], ce_z: list[float],
                points: int = 32) -> list[float]:
    """Each block's share of what the network adds to z's own likelihood, by block index (block 0 = highest
    sigma): the mean of max(ce_z - ce, 0) over `points` ln-spaced sigmas inside the block's interval."""
    B = len(edges) - 1
    gains = []
    for b in range(B):
        lo, hi = math.log(edges[B - 1 - b]), math.log(edges[B - b])
        grid = [math.exp(lo + (hi - lo) * (i + 0.5) / points) for i in range(points)]
        gains.append(sum(max(_ce_at_sigma(sigmas, ce_z, s) - _ce_at_sigma(sigmas, ce, s), 0.0) for s in grid) / points)
    return _normalised(gains)


def _normalised(values: list[float]) -> list[float]:
    total = sum(values)
    if total <= 1e-9:
        return [1.0 / len(values)] * len(values)
    return [v / total for v in values]

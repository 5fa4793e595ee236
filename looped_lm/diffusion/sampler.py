"""Inference: the σ grid and the Euler step of K-step routed denoising (docs/method.md §5).

A chain for one token: z ~ N(0, σ_hi²·I); for k = 0 … K−1 run the block that owns σ_k, get the
denoised estimate D, and move z from σ_k to σ_{k+1} with `euler_step`. The grid therefore has
K+1 points: K where the network is evaluated, and σ_K = σ_lo, where the chain ends.
"""

from __future__ import annotations

from looped_lm.diffusion.noise import NoiseSchedule, cdf_range, check_interval, sigma_at_fraction
from looped_lm.diffusion.partition import check_edges, route_sigma
from looped_lm.errors import UserError


def _check_num_iterations(num_iterations) -> None:
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int):
        raise UserError(f"num_iterations must be an integer (got {num_iterations!r})")
    if num_iterations < 1:
        raise UserError(f"num_iterations must be >= 1 (got {num_iterations})")


def inference_sigmas(K: int, sched: NoiseSchedule, lo: float | None = None, hi: float | None = None) -> list[float]:
    """K+1 descending σ values, equally spaced in the truncated log-normal CDF from hi down to lo.

    q_k = q_hi − (k/K)(q_hi − q_lo), σ_k = icdf(q_k); σ_0 = hi and σ_K = lo exactly. Step k
    evaluates the network at σ_k and moves z to σ_{k+1}; σ_K is only where the chain ends.
    Equal CDF spacing (not Karras ρ=7) spends steps where training put its σ draws, and with
    K = B on the equi-probability partition the steps land exactly on the block edges.
    lo / hi default to σ_min / σ_max.
    """
    sched.validate()
    _check_num_iterations(K)
    lo = float(sched.sigma_min if lo is None else lo)
    hi = float(sched.sigma_max if hi is None else hi)
    check_interval(lo, hi)
    q_lo, q_hi = cdf_range(lo, hi, sched)
    # Written as the fraction (K−k)/K from q_lo (same value as q_hi − k/K·Δq) so a grid point and an
    # equi-probability edge at the same quantile are computed by the same float expression.
    inner = [sigma_at_fraction((K - k) / K, q_lo, q_hi, sched) for k in range(1, K)]
    return [hi, *inner, lo]


def euler_step(z, denoised, sigma, sigma_next):
    """One Euler step of the probability-flow ODE dz/dσ = (z − D)/σ, from σ to σ_next.

    z + (σ_next − σ)·(z − D)/σ, sign as in the reference code. If D is the exact clean target and
    z = y + σ·ε, the result is y + σ_next·ε; stepping to σ_next = 0 returns D.
    sigma / sigma_next: floats or tensors broadcastable against z (e.g. [N, 1, 1]).
    """
    return z + (sigma_next - sigma) * (z - denoised) / sigma


def route_steps(K: int, edges, sched: NoiseSchedule) -> list[int]:
    """The block run at each of the K steps: route_sigma(σ_k) for k < K.

    The grid spans the partition's own range [edges[0], edges[-1]] (for the config-built partitions
    that is [σ_min, σ_max]). K = B on the equi-probability partition visits 0, 1, …, B−1 once
    each; K = mB visits each block m times in order; K < B skips blocks.
    """
    edges = check_edges(edges)
    sigmas = inference_sigmas(K, sched, lo=edges[0], hi=edges[-1])
    return [route_sigma(s, edges) for s in sigmas[:-1]]

"""Noise distribution and EDM preconditioning (docs/method.md §1).

Variance-exploding noise: z = y + σ·ε. During training ln σ ~ N(P_mean, P_std²) truncated to an
interval [lo, hi] (the whole range, or one block's widened interval). Everything here is a pure
function; the quantile maths runs in float64 because the tails of the range (σ_min = 0.002 is
about 4.2 standard deviations below P_mean) lose digits fast in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch
from torch import Tensor

from looped_lm.errors import UserError

_STD_NORMAL = NormalDist()


@dataclass(frozen=True)
class NoiseSchedule:
    """The `diffusion.*` noise settings. Defaults are the paper's (EDM's) values."""

    p_mean: float = -1.2
    p_std: float = 1.2
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_data: float = 0.5

    @classmethod
    def of(cls, section) -> "NoiseSchedule":
        """The schedule a `diffusion:` section (anything with these five fields) sets: every model's, built here."""
        return cls(section.p_mean, section.p_std, section.sigma_min, section.sigma_max, section.sigma_data)

    def validate(self) -> "NoiseSchedule":
        """Raise UserError naming the offending `diffusion.*` key; returns self for chaining."""
        for name in ("p_mean", "p_std", "sigma_min", "sigma_max", "sigma_data"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"diffusion.{name} must be a finite number (got {value!r})")
        if self.sigma_min <= 0:
            raise UserError(f"diffusion.sigma_min must be > 0 (got {self.sigma_min})")
        if self.sigma_min >= self.sigma_max:
            raise UserError(
                f"diffusion.sigma_min ({self.sigma_min}) must be below diffusion.sigma_max ({self.sigma_max})"
            )
        if self.p_std <= 0:
            raise UserError(f"diffusion.p_std must be > 0 (got {self.p_std})")
        if self.sigma_data <= 0:
            raise UserError(f"diffusion.sigma_data must be > 0 (got {self.sigma_data})")
        return self


def _as_float64(x) -> Tensor:
    """Python numbers become float64 tensors; tensors pass through unchanged."""
    return x if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float64)


def check_interval(lo: float, hi: float) -> None:
    """A σ interval must satisfy 0 < lo < hi (both finite)."""
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
        raise UserError(f"sigma interval [{lo}, {hi}] must satisfy 0 < lo < hi")


# ---------------------------------------------------------------------------------------------
# EDM preconditioning


def edm_scalings(sigma, sigma_data: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(c_skip, c_out, c_in, c_noise) of EDM, elementwise in σ (any shape, same shape out).

    They keep the network's input and target at unit variance whatever σ is:
    c_skip = σd²/(σ²+σd²), c_out = σ·σd/√(σ²+σd²), c_in = 1/√(σ²+σd²), c_noise = ¼·ln σ.
    """
    sigma = _as_float64(sigma)
    total = sigma**2 + sigma_data**2  # σ² + σd², the variance of z
    c_skip = sigma_data**2 / total
    c_out = sigma * sigma_data / total.sqrt()
    c_in = total.rsqrt()
    c_noise = sigma.log() / 4
    return c_skip, c_out, c_in, c_noise


def edm_weight(sigma, sigma_data: float) -> Tensor:
    """EDM loss weight w(σ) = (σ²+σd²)/(σ·σd)² = 1/σ² + 1/σd²; it equals 1/c_out²."""
    sigma = _as_float64(sigma)
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


# ---------------------------------------------------------------------------------------------
# Log-normal CDF and its inverse


def _phi(x: float) -> float:
    """Standard normal CDF via erfc: keeps full relative precision in the lower tail, where
    NormalDist.cdf's 1 + erf(x) cancels (σ_min sits at Φ ≈ 1.5e-5)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def lognormal_cdf(sigma, p_mean: float, p_std: float):
    """Φ((ln σ − P_mean)/P_std): float in, float out; tensor in, tensor out."""
    if isinstance(sigma, Tensor):
        return torch.special.ndtr((sigma.log() - p_mean) / p_std)
    return _phi((math.log(sigma) - p_mean) / p_std)


def lognormal_icdf(q, p_mean: float, p_std: float):
    """exp(P_mean + P_std·Φ⁻¹(q)), the inverse of `lognormal_cdf`; q must lie in (0, 1)."""
    if isinstance(q, Tensor):
        return torch.exp(p_mean + p_std * torch.special.ndtri(q))
    return math.exp(p_mean + p_std * _STD_NORMAL.inv_cdf(q))


def cdf_range(lo: float, hi: float, sched: NoiseSchedule) -> tuple[float, float]:
    """(q_lo, q_hi): the untruncated CDF at the two ends of a σ interval."""
    return (lognormal_cdf(float(lo), sched.p_mean, sched.p_std),
            lognormal_cdf(float(hi), sched.p_mean, sched.p_std))


def sigma_at_fraction(frac: float, q_lo: float, q_hi: float, sched: NoiseSchedule) -> float:
    """σ at CDF fraction `frac` ∈ [0, 1] of the log-normal truncated to [icdf(q_lo), icdf(q_hi)].

    The partition edges and the inference grid both go through this one expression, so a grid
    point meant to sit on an edge is bitwise equal to it (see `partition.route_sigma`).
    """
    return lognormal_icdf(q_lo + frac * (q_hi - q_lo), sched.p_mean, sched.p_std)


# ---------------------------------------------------------------------------------------------
# Training-time sampling and loss normalisation


def sample_sigma(
    n: int,
    lo: float,
    hi: float,
    sched: NoiseSchedule,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """n draws of σ from the log-normal truncated to [lo, hi] -> float32 Tensor[n].

    Inverse-CDF sampling (u ~ U(q_lo, q_hi), σ = icdf(u)): exactly one uniform per sample, no
    rejection loop, so the cost and the RNG stream do not depend on how narrow the block is.
    Deterministic for a seeded generator. The uniforms are drawn on the generator's device.
    """
    check_interval(lo, hi)
    q_lo, q_hi = cdf_range(lo, hi, sched)
    gen_device = generator.device if generator is not None else (device or "cpu")
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=gen_device)  # [n] in [0, 1)
    sigma = lognormal_icdf(q_lo + u * (q_hi - q_lo), sched.p_mean, sched.p_std)
    # Rounding (and the float32 cast) may step a hair outside the interval: clamp in float32.
    sigma = sigma.to(torch.float32).clamp(min=lo, max=hi)
    return sigma if device is None else sigma.to(device)


def _normal_mass(a: float, b: float) -> float:
    """Φ(b) − Φ(a) for a ≤ b, computed on the side of 0 where it does not cancel."""
    if a > 0:  # both in the upper tail: use the survival function, Φ(−a) − Φ(−b)
        return _phi(-a) - _phi(-b)
    return _phi(b) - _phi(a)


def edm_loss_weight_normaliser(lo: float, hi: float, sched: NoiseSchedule) -> float:
    """E[w(σ)] for σ from the log-normal truncated to [lo, hi], in closed form.

    `loss_weight: edm` divides w(σ) by this so the per-block loss stays O(1) (docs/method.md §1).
    w(σ) = 1/σd² + σ⁻², and for X = ln σ ~ N(μ, s²) truncated to [α, β] (standardised ends)
    E[e^{−2X}] = e^{−2μ + 2s²}·(Φ(β + 2s) − Φ(α + 2s))/(Φ(β) − Φ(α)). Exact and deterministic,
    where a quadrature would struggle with the 1/σ² spike at σ_min.
    """
    check_interval(lo, hi)
    mu, s = sched.p_mean, sched.p_std
    alpha = (math.log(lo) - mu) / s
    beta = (math.log(hi) - mu) / s
    inv_sigma_sq = math.exp(-2 * mu + 2 * s * s) * _normal_mass(alpha + 2 * s, beta + 2 * s) / _normal_mass(alpha, beta)
    return 1.0 / sched.sigma_data**2 + inv_sigma_sq

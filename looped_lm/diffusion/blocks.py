"""The DiffusionBlocks mechanics every kind shares (docs/method.md §2, §3, §5): which block a training step
trains, and where a K-step chain calls its blocks. db_ar, looped_db, vit, dit and mdm all use these; the
sigma law and the partition themselves are `noise.py` and `partition.py`, the chain's loop and bridges
`chain.py`.

Training: `choose_block(step, seed, pool, ...)` depends on (step, seed) alone, so every rank of a
data-parallel job agrees without talking.

Inference: a `ChainGrid` places K calls equally in the noise CDF from `sigma_top` (a high quantile of
block 0's training law, `top_of_block0`; 1 = sigma_max) down to the partition's bottom. With
`last_call: sigma_min` (the default, and the official DiffusionBlocks code's grid: B calls on the
inclusive CDF grid [sigma_max, ..., sigma_min]) the K-th call runs at sigma_min itself; with `edge` the
K calls are the top edges of K equal CDF steps and the chain ends at sigma_min without a call there.
Calls beyond B (`extra_calls`): `spread` (vit's and dit's default) places all K equally, so every block gets
about K / B of them; `block0` (the language models' default) keeps the K = B grid and spends the extra K - B
calls inside block 0's interval, from sigma_top down, where the recipes put most training steps (docs/method.md
§5: on SmolLM2 and the quickstart, spread loses at K = 2B and 4B what block0 keeps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_lm.diffusion.noise import NoiseSchedule, cdf_range, sigma_at_fraction
from looped_lm.diffusion.partition import route_sigma
from looped_lm.diffusion.sampler import inference_sigmas


def choose_block(step: int, seed: int, pool, sampling: str = "uniform", weights=None) -> int:
    """The block trained at `step`, from `pool` (the trainable block indices): round_robin cycles through
    the pool; otherwise a draw from a generator seeded by (seed, step): uniform, or in proportion to
    `weights` (one per pool entry, as `block_sampling: loss_share` gives)."""
    pool = list(pool)
    if sampling == "round_robin":
        return pool[step % len(pool)]
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if weights is not None:
        return pool[int(torch.multinomial(torch.as_tensor(weights, dtype=torch.float64), 1, generator=g))]
    return pool[int(torch.randint(len(pool), (1,), generator=g))]


@dataclass(frozen=True)
class ChainGrid:
    """Where a K-step chain evaluates: equal steps in the noise CDF from sigma_top down the partition's
    range. `last_call`: "sigma_min" puts the last of the K calls at the bottom edge itself (the official
    code's inclusive grid; with the likelihood parameterization an exact read-back of the token the last
    bridge drew); "edge" ends the calls on the last grid point above the bottom edge."""

    edges: tuple[float, ...]  # ascending partition edges, edges[0] = sigma_lo
    sigma_top: float  # where every chain starts (docs/method.md §5)
    last_call: str
    sched: NoiseSchedule
    extra_calls: str = "spread"

    def sigmas(self, K: int) -> list[float]:
        """K + 1 descending points: calls at the first K, the chain ends at the last."""
        B = len(self.edges) - 1
        if self.extra_calls == "block0" and 1 < B < K:
            # K - B + 1 calls equally in block 0's CDF from sigma_top (its lower edge excluded), then the
            # K = B grid after its first call: blocks 1 .. B - 1 run as they do at K = B
            inside = inference_sigmas(K - B + 1, self.sched, lo=self.edges[-2], hi=self.sigma_top)[:-1]
            inside[0] = self.sigma_top
            return inside + self._spread(B)[1:]
        return self._spread(K)

    def _spread(self, K: int) -> list[float]:
        lo, hi = self.edges[0], self.edges[-1]
        if self.last_call == "sigma_min" and K >= 2:
            sigmas = inference_sigmas(K - 1, self.sched, lo=lo, hi=hi)
            sigmas.append(sigmas[-1])
        else:
            sigmas = inference_sigmas(K, self.sched, lo=lo, hi=hi)
        sigmas[0] = self.sigma_top
        return sigmas

    def blocks(self, K: int) -> list[int]:
        """The block run at each of the K calls."""
        return [route_sigma(s, list(self.edges)) for s in self.sigmas(K)[:-1]]

    def steps_per_block(self, K: int) -> list[int]:
        """How many of the K calls each block runs (block 0 first)."""
        counts = [0] * (len(self.edges) - 1)
        for b in self.blocks(K):
            counts[b] += 1
        return counts


def top_of_block0(train_range: tuple[float, float], edges, quantile: float, sched: NoiseSchedule) -> float:
    """sigma_top: a high quantile of block 0's training sigma law (not sigma_max, which a log-normal
    almost never draws), kept inside block 0's interval."""
    q_lo, q_hi = cdf_range(*train_range, sched)
    top = sigma_at_fraction(quantile, q_lo, q_hi, sched)
    return float(min(max(top, edges[-2]), edges[-1]))


def chain_grid(edges, train_ranges, sched: NoiseSchedule, top_quantile: float, last_call: str,
               extra_calls: str = "spread") -> ChainGrid:
    """The grid of a model with these partition `edges` (ascending) and per-block training intervals
    (`train_ranges[0]` = block 0's): chains start at `top_quantile` of block 0's law (1 = sigma_max)."""
    top = top_of_block0(train_ranges[0], edges, top_quantile, sched)
    return ChainGrid(tuple(float(e) for e in edges), top, last_call, sched, extra_calls)

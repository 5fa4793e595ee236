"""The K-step routed denoising chain (docs/method.md §5): the one implementation behind `generate`, the
engine, the HF wrapper and the vLLM backend. Its estimator twin for scoring is `estimator.py`.

For each slot (one token to predict): z_0 ~ N(0, sigma_top^2 I); for k = 0 .. K-1 the block that owns
sigma_k maps (z_k, sigma_k) to logits; between steps a bridge turns the logits into a denoised point D_k
(hard: the argmax token's target, soft: the expected target, sample: a drawn token's target) and an Euler
step moves z to sigma_{k+1}. The last step's logits are the token's distribution.

The chain knows nothing of networks: `denoise(block, z, sigma, rows)` runs one block for the given rows
(window scoring and cached decoding supply their own). Rows may differ in K, bridge, sampler, exit rule
and random stream: at each step the rows routed to the same block share one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from looped_lm.diffusion.adaptive_exit import ExitTracker
from looped_lm.diffusion.noise import NoiseSchedule, cdf_range, sigma_at_fraction
from looped_lm.diffusion.partition import route_sigma
from looped_lm.diffusion.sampler import euler_step, inference_sigmas
from looped_lm.sampling import RandomSource, SamplingParams, draw_rows
from looped_lm.settings import InferenceSettings

# denoise(block, z (R', n, d), sigma (R',), rows (R',) indices into the chain's rows) -> logits (R', n, V)
Denoise = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ChainGrid:
    """Where a K-step chain evaluates: equal steps in the noise CDF from sigma_top down the partition's
    range. `last_call`: the last call sits on the last grid point above the bottom edge ("edge", the
    paper) or at the bottom edge itself ("sigma_min": with the likelihood parameterization an exact
    read-back of the token the last bridge drew)."""

    edges: tuple[float, ...]  # ascending partition edges, edges[0] = sigma_lo
    sigma_top: float  # where every chain starts (docs/method.md §5)
    last_call: str
    sched: NoiseSchedule

    def sigmas(self, K: int) -> list[float]:
        """K + 1 descending points: calls at the first K, the chain ends at the last."""
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


def top_of_block0(train_range: tuple[float, float], edges, quantile: float, sched: NoiseSchedule) -> float:
    """sigma_top: a high quantile of block 0's training sigma law (not sigma_max, which a log-normal
    almost never draws), kept inside block 0's interval."""
    q_lo, q_hi = cdf_range(*train_range, sched)
    top = sigma_at_fraction(quantile, q_lo, q_hi, sched)
    return float(min(max(top, edges[-2]), edges[-1]))


@dataclass
class ChainResult:
    logits: torch.Tensor  # (R, n, V): the last step's logits of each slot (its exit step under a rule)
    iterations: torch.Tensor  # (R, n): calls each slot used


def bridge_points(logits: torch.Tensor, kinds: list[str], sampling: list[SamplingParams], random: RandomSource,
                  rows: torch.Tensor, targets: Callable, table: Callable) -> torch.Tensor:
    """Logits (R', n, V) -> denoised points (R', n, d), row i with bridge kinds[i]: hard = the argmax
    token's target, soft = the targets' expectation, sample = a token drawn with the row's sampler."""
    out = None
    for kind in sorted(set(kinds)):
        sel = torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=logits.device)
        part = logits if len(sel) == len(kinds) else logits[sel]
        if kind == "hard":
            points = targets(part.argmax(-1))
        elif kind == "soft":
            points = part.float().softmax(-1) @ table()
        else:
            points = targets(draw_rows(part, [sampling[i] for i in sel.tolist()], random, rows[sel], part.shape[1]))
        if len(sel) == len(kinds):
            return points
        if out is None:
            out = points.new_empty(logits.shape[:-1] + points.shape[-1:])
        out[sel] = points
    return out


def run_chain(denoise: Denoise, grid: ChainGrid, settings: list[InferenceSettings], z: torch.Tensor,
              random: RandomSource, targets: Callable, table: Callable) -> ChainResult:
    """Run each row's chain from z (R, n, d) at sigma_top. targets(ids) -> points; table() -> (V, d)."""
    R, n = z.shape[:2]
    device = z.device
    z = z.clone()  # stepped in place, row by row
    Ks = [s.num_iterations for s in settings]
    plans = {K: (grid.sigmas(K), grid.blocks(K)) for K in set(Ks)}
    tracker = ExitTracker([s.exit_rule for s in settings], n, device)
    done = torch.zeros(R, n, dtype=torch.bool, device=device)
    used = torch.zeros(R, n, dtype=torch.long, device=device)
    final = None
    for k in range(max(Ks)):
        alive = [r for r in range(R) if k < Ks[r] and not bool(done[r].all())]
        if not alive:
            break
        groups: dict[int, list[int]] = {}
        for r in alive:
            groups.setdefault(plans[Ks[r]][1][k], []).append(r)
        for b, members in groups.items():
            idx = torch.tensor(members, device=device)
            sigma = torch.tensor([plans[Ks[r]][0][k] for r in members], device=device, dtype=torch.float32)
            every = len(members) == R
            logits = denoise(b, z if every else z[idx], sigma, idx).float()
            if final is None:
                final = torch.zeros(R, n, logits.shape[-1], device=device)
            live = ~done[idx]
            used[idx] += live.long()
            if every and not tracker.active:
                final = logits
            else:
                final[idx] = torch.where(live[..., None], logits, final[idx])
            stop = tracker.update(idx, logits) & live
            done[idx] |= stop
            going = [i for i, r in enumerate(members) if k + 1 < Ks[r]]
            if not going:
                continue
            gi = torch.tensor(going, device=device)
            rows = idx[gi]
            part = logits if len(going) == len(members) else logits[gi]
            points = bridge_points(part, [settings[r].bridge for r in rows.tolist()],
                                   [settings[r].sampling for r in rows.tolist()], random, rows, targets, table)
            s_now = sigma[gi].double()[:, None, None]
            s_next = torch.tensor([plans[Ks[r]][0][k + 1] for r in rows.tolist()], device=device,
                                  dtype=torch.float64)[:, None, None]
            z_rows = z[rows]
            stepped = euler_step(z_rows.double(), points.double(), s_now, s_next).to(z.dtype)
            z[rows] = torch.where(done[rows][..., None], z_rows, stepped)
    return ChainResult(final, used)

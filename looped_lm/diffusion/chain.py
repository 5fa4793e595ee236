"""The K-step routed denoising chain (docs/method.md §5): the one implementation behind `generate`, the
engine, the HF wrapper, the vLLM backend, the vit's prediction and the dit's sampler. Its estimator twin
for scoring is `estimator.py`; where it calls its blocks is `blocks.ChainGrid`.

For each slot (one token to predict): z_0 ~ N(0, sigma_top^2 I); for k = 0 .. K-1 the block that owns
sigma_k maps (z_k, sigma_k) to logits; between steps a bridge turns the logits into a denoised point D_k
(hard: the argmax token's target, soft: the expected target, sample: a drawn token's target) and an Euler
step moves z to sigma_{k+1}. The last step's logits are the token's distribution.

The chain knows nothing of networks: `denoise(block, z, sigma, rows)` runs one block for the given rows
(window scoring and cached decoding supply their own). Rows may differ in K, bridge, sampler, exit rule
and random stream: at each step the rows routed to the same block share one call. A denoiser whose
output already is the denoised point (the dit's image D) passes `points` instead of a bridge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from looped_lm.diffusion.adaptive_exit import ExitTracker
from looped_lm.diffusion.blocks import ChainGrid, top_of_block0  # noqa: F401 (the grid; importers find it here too)
from looped_lm.diffusion.sampler import euler_step
from looped_lm.sampling import RandomSource, SamplingParams, draw_rows
from looped_lm.settings import InferenceSettings

# denoise(block, z (R', n, d), sigma (R',), rows (R',) indices into the chain's rows) -> logits (R', n, V)
Denoise = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ChainResult:
    logits: torch.Tensor  # (R, n, V): the last step's logits of each slot (its exit step under a rule)
    iterations: torch.Tensor  # (R, n): calls each slot used


def fixed_bridge(logits: torch.Tensor, kind: str, targets: Callable, table: Callable) -> torch.Tensor:
    """The deterministic bridges, logits (R', n, V) -> denoised points (R', n, d): hard = the argmax
    token's target, soft = the targets' expectation. (The estimator runs these chains too.)"""
    if kind == "hard":
        return targets(logits.argmax(-1))
    return logits.float().softmax(-1) @ table()


def euler_to(z: torch.Tensor, points: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """One Euler step of the chain from sigma to sigma_next towards `points`, in float64, back in z's dtype."""
    return euler_step(z.double(), points.double(), sigma, sigma_next).to(z.dtype)


def bridge_points(logits: torch.Tensor, kinds: list[str], sampling: list[SamplingParams], random: RandomSource,
                  rows: torch.Tensor, targets: Callable, table: Callable) -> torch.Tensor:
    """Logits (R', n, V) -> denoised points (R', n, d), row i with bridge kinds[i]: hard = the argmax
    token's target, soft = the targets' expectation, sample = a token drawn with the row's sampler."""
    out = None
    for kind in sorted(set(kinds)):
        sel = torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=logits.device)
        part = logits if len(sel) == len(kinds) else logits[sel]
        if kind in ("hard", "soft"):
            points = fixed_bridge(part, kind, targets, table)
        else:
            points = targets(draw_rows(part, [sampling[i] for i in sel.tolist()], random, rows[sel], part.shape[1]))
        if len(sel) == len(kinds):
            return points
        if out is None:
            out = points.new_empty(logits.shape[:-1] + points.shape[-1:])
        out[sel] = points
    return out


def run_chain(denoise: Denoise, grid: ChainGrid, settings: list[InferenceSettings], z: torch.Tensor,
              random: RandomSource | None, targets: Callable | None, table: Callable | None,
              points: Callable | None = None) -> ChainResult:
    """Run each row's chain from z (R, n, d) at sigma_top. targets(ids) -> points; table() -> (V, d).
    points(outputs (R', n, d), rows (R',)) -> denoised points, when given, replaces the rows' bridges."""
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
            if points is None:
                denoised = bridge_points(part, [settings[r].bridge for r in rows.tolist()],
                                         [settings[r].sampling for r in rows.tolist()], random, rows, targets, table)
            else:
                denoised = points(part, rows)
            s_now = sigma[gi].double()[:, None, None]
            s_next = torch.tensor([plans[Ks[r]][0][k + 1] for r in rows.tolist()], device=device,
                                  dtype=torch.float64)[:, None, None]
            z_rows = z[rows]
            stepped = euler_to(z_rows, denoised, s_now, s_next)
            z[rows] = torch.where(done[rows][..., None], z_rows, stepped)
    return ChainResult(final, used)

"""An unbiased estimate of the K-step sampler's token probability p_K(y) (docs/method.md §6).

p_K(y) = E[softmax(last call's logits)(y)] over the chain's randomness: the starting noise z_0 and,
with the `sample` bridge, the token drawn at each of the first K - 1 steps. A plain average of a few
chains is unbiased but useless: a chain commits to its drawn token early, so p_final(y) is ~1 on the
rare paths that drew y and ~0 elsewhere, and -log(mean of a few) explodes. Given z_0 this estimator

  1. stratifies the first draw: the top-m tokens of step 0, the target y, and ONE token drawn from the
     rest of step 0's distribution (weighted by that rest's mass) each start a branch with weight
     p_0(v) (the rest's branch: its mass), so every token is reachable and the sum is exact in
     expectation;
  2. draws every later token of a branch from a defensive mixture over whole paths: each branch runs,
     with probability 1/2 each, either the sampler itself or the boosted chain whose draws come from
     q_k = (1 - boost) p_k + boost * [v = y] (paths that return to y are visited often); the branch
     weight is multiplied by p(path) / (p(path)/2 + q(path)/2) = 2 / (1 + prod_k q_k(v_k) / p_k(v_k)),
     which is <= 2 at every K (a per-step ratio p_k / q_k <= 1 / (1 - boost) multiplied over K - 3
     draws is not bounded: 2^13 at K = 16, estimates far above 1);
  3. returns sum over branches of weight * p_final(y), and on request the whole vector
     sum weight * p_final(.) (unbiased for every token at once: the marginal the sampler draws from).

Every estimate lies in [0, 2] (the branch weights p_0(v) sum to 1 and each path factor is <= 2).

Each call is unbiased for p_K(y | z_0); averaging independent calls (fresh z_0) gives p_K(y) and, from
their spread, a standard error. The hard and soft bridges are deterministic given z_0: one chain per
call. The sampler scored is the model's own distribution (temperature 1, no top-k / top-p).
"""

from __future__ import annotations

from typing import Callable

import torch

from looped_lm.diffusion.adaptive_exit import ExitTracker
from looped_lm.diffusion.chain import ChainGrid, Denoise, euler_to, fixed_bridge
from looped_lm.sampling import RandomSource, draw
from looped_lm.settings import ExitRule

BRANCH_BUDGET = 2 ** 26  # logits entries per call: branches run in chunks that stay under it
# An estimate is "unresolved", reported as such and never as a number, when its standard error is not
# small against it: a token's log-prob whose se exceeds 1 nat (se(p) > p: not even p's size is known), a
# mean NLL (log-ppl) whose se exceeds 0.25 nats (docs/method.md §6).
UNRESOLVED_TOKEN_SE = 1.0
UNRESOLVED_MEAN_SE = 0.25


def sampler_probs(denoise: Denoise, grid: ChainGrid, K: int, z0: torch.Tensor, y: torch.Tensor,
                  random: RandomSource, targets: Callable, table: Callable, bridge: str, candidates: int = 8,
                  boost: float = 0.5, full: bool = False, exit_rule: ExitRule | None = None):
    """One unbiased estimate, given z0 (R, n, d): (p (R, n) float64 of y (R, n), the full marginal
    (R, n, V) float32 or None, mean iterations (R, n) float64)."""
    R, n = y.shape
    device = z0.device
    rows = torch.arange(R, device=device)
    sigmas, blocks = grid.sigmas(K), grid.blocks(K)
    first = denoise(blocks[0], z0, torch.full((R,), sigmas[0], device=device), rows).float()
    p0 = first.softmax(-1)
    ones = torch.ones(R, n, dtype=torch.float64, device=device)
    if K == 1:
        return p0.gather(-1, y[..., None])[..., 0].double(), (p0 if full else None), ones
    if bridge != "sample":
        z, logits = z0, first
        for k in range(K - 1):  # deterministic given z0: the chain itself, through its own bridge and step
            z = euler_to(z, fixed_bridge(logits, bridge, targets, table), sigmas[k], sigmas[k + 1])
            logits = denoise(blocks[k + 1], z, torch.full((R,), sigmas[k + 1], device=device), rows).float()
        p = logits.softmax(-1)
        return p.gather(-1, y[..., None])[..., 0].double(), (p if full else None), ones * K

    # 1. stratified first draw: top-m, the target, one draw from the rest
    V = p0.shape[-1]
    m = min(candidates, V)
    top = p0.topk(m, dim=-1).indices if m else y.new_zeros(R, n, 0)
    listed = torch.zeros(R, n, V, dtype=torch.bool, device=device)
    listed.scatter_(-1, top, True)
    y_listed = listed.gather(-1, y[..., None])[..., 0]
    listed.scatter_(-1, y[..., None], True)
    rest = p0.masked_fill(listed, 0.0)
    rest_mass = rest.double().sum(-1)
    rest_token = draw(rest + (rest_mass[..., None] == 0).float() * listed.float(),  # nothing left: any listed
                      random.uniform(rows, n, device))
    cands = torch.cat([top, y[..., None], rest_token[..., None]], dim=-1)  # (R, n, m + 2)
    weights = torch.cat([p0.gather(-1, top).double(), (p0.gather(-1, y[..., None])[..., 0].double() * ~y_listed)[..., None],
                         rest_mass[..., None]], dim=-1)
    M = cands.shape[-1]

    p_y = torch.zeros(R, n, dtype=torch.float64, device=device)
    iters = torch.zeros(R, n, dtype=torch.float64, device=device)
    marginal = torch.zeros(R, n, V, device=device) if full else None
    chunk = max(1, min(M, BRANCH_BUDGET // max(1, R * n * V)))
    for start in range(0, M, chunk):
        js = list(range(start, min(M, start + chunk)))
        c = len(js)
        # branch-major rows: branch j of row r sits at j * R + r
        idx = rows.repeat(c)
        yb = y.repeat(c, 1)
        w = torch.cat([weights[..., j] for j in js])
        z = euler_to(z0.repeat(c, 1, 1), targets(torch.cat([cands[..., j] for j in js])), sigmas[0], sigmas[1])
        tracker = ExitTracker([exit_rule] * (R * c), n, device)
        if exit_rule is not None:
            tracker.update(torch.arange(R * c, device=device), first.repeat(c, 1, 1))
        done = torch.zeros(R * c, n, dtype=torch.bool, device=device)
        used = torch.ones(R * c, n, dtype=torch.float64, device=device)
        # 2. which half of the mixture this path follows (K <= 3 has no middle draw)
        boosted = random.uniform(idx, n, device) < 0.5 if K > 3 else done
        log_q_over_p = torch.zeros(R * c, n, dtype=torch.float64, device=device)
        final = None
        for k in range(1, K - 1):  # the middle draws (steps 1 .. K-3) and the last draw (step K-2)
            logits = denoise(blocks[k], z, torch.full((R * c,), sigmas[k], device=device), idx).float()
            p = logits.softmax(-1)
            live = ~done
            used += live.double()
            final = p if final is None else torch.where(live[..., None], p, final)
            if exit_rule is not None:
                done |= tracker.update(torch.arange(R * c, device=device), logits) & live
            if k + 1 == K - 1:
                break
            # 2. a draw from the sampler or from the boosted chain, the path's q / p ratio tracked
            onehot = torch.zeros_like(p).scatter_(-1, yb[..., None], 1.0)
            q = (1 - boost) * p + boost * onehot
            v = draw(torch.where(boosted[..., None], q, p), random.uniform(idx, n, device))
            step_ratio = (q.gather(-1, v[..., None])[..., 0].double().log()
                          - p.gather(-1, v[..., None])[..., 0].double().log())  # +inf where p(v) = 0
            log_q_over_p = torch.where(done, log_q_over_p, log_q_over_p + step_ratio)
            z = torch.where(done[..., None], z, euler_to(z, targets(v), sigmas[k], sigmas[k + 1]))
        w = w * 2 / (1 + log_q_over_p.clamp(max=700).exp())  # the mixture weight, <= 2
        if K == 2:  # the first draw was the last one: one final call per branch
            logits = denoise(blocks[1], z, torch.full((R * c,), sigmas[1], device=device), idx).float()
            final, used = logits.softmax(-1), used + 1
        else:
            # 3. the last draw, split in two: the target itself, and one draw from the rest (weighted by
            # the rest's mass); each gets its final call
            p_last = final
            p_y_last = p_last.gather(-1, yb[..., None])[..., 0].double()
            rest = p_last.scatter(-1, yb[..., None], 0.0)
            v_rest = draw(rest + (rest.sum(-1, keepdim=True) == 0).float(), random.uniform(idx, n, device))
            outs = []
            for v, share in ((yb, p_y_last), (v_rest, 1 - p_y_last)):
                z_v = torch.where(done[..., None], z, euler_to(z, targets(v), sigmas[K - 2], sigmas[K - 1]))
                logits = denoise(blocks[K - 1], z_v, torch.full((R * c,), sigmas[K - 1], device=device), idx).float()
                outs.append((share, logits.softmax(-1)))
            live = ~done
            final_mix = outs[0][0][..., None].float() * outs[0][1] + outs[1][0][..., None].float() * outs[1][1]
            final = torch.where(live[..., None], final_mix, final)
            used += live.double()
        # 3. the weighted sum over branches
        contrib = (w * final.gather(-1, yb[..., None])[..., 0].double()).view(c, R, n)
        p_y += contrib.sum(0)
        iters += (w * used).view(c, R, n).sum(0)
        if full:
            marginal += (w.float()[..., None] * final).view(c, R, n, V).sum(0)
    return p_y, marginal, iters


def jackknife_nll(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-log of the mean of N independent unbiased estimates p (N, ...) of a probability, with the
    jackknife's bias correction (-log(mean) overstates the NLL by about var / (2 N p^2), Jensen) and its
    variance estimate. -> (nll (...) >= 0, variance of the nll (...) or None when N == 1).

    A probability is at most 1, so the mean is clipped there (an estimate above 1 is known to be too
    high: the clip only moves it closer). The correction is kept within [0, variance] (first order it is
    variance / 2) and made only where the token is resolved (se <= UNRESOLVED_TOKEN_SE): where the
    estimates disagree by orders of magnitude the jackknife's own correction swings by hundreds of
    nats (-512 measured, a log-prob of +512), while the variance already says the token is unresolved."""
    N = p.shape[0]
    p = p.double()
    full = -p.mean(0).clamp(1e-300, 1.0).log()
    if N == 1:
        return full, None
    leave_one = -((p.sum(0, keepdim=True) - p) / (N - 1)).clamp(1e-300, 1.0).log()  # (N, ...)
    mean_leave = leave_one.mean(0)
    var = (N - 1) / N * ((leave_one - mean_leave) ** 2).sum(0)
    correction = (N - 1) * (mean_leave - full)  # full - the jackknife estimate
    correction = torch.where(var <= UNRESOLVED_TOKEN_SE ** 2, torch.minimum(correction.clamp_min(0.0), var), 0.0)
    nll = (full - correction).clamp_min(0.0)
    return nll, var

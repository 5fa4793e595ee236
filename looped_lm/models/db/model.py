"""`DiffusionBlocksLM` (model.kind db_ar and looped_db): the network plus the contract's capabilities.

    network     DBNetwork (network.py): parameters, clean encoder, noisy step
    training    BlockObjective (objective.py): one block per step, chosen by the BlockSchedule
                (models/blockwise.py) that also holds the partition and the measured CE curve
    decoding    DecodeState / CachedContext (contexts.py) + the chain (looped_lm/diffusion/chain.py)
    scoring     WindowContext (contexts.py) + the estimator (looped_lm/diffusion/estimator.py): ppl@k

Every K-step chain, in `generate`, the engine, the HF wrapper, the vLLM backend and eval, runs through
`looped_lm.diffusion.chain` (sampling) or `looped_lm.diffusion.estimator` (scoring).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from looped_lm.diffusion.chain import ChainGrid, run_chain, top_of_block0
from looped_lm.diffusion.estimator import jackknife_nll, sampler_probs
from looped_lm.errors import UserError
from looped_lm.models.args import DBArgs
from looped_lm.models.blockwise import BlockSchedule, BlockwiseTrainable, noise_partition
from looped_lm.models.contract import (CachedDecoding, EstimatedLogprobs, FixedShapeBlocks, Iterative, Scorable,
                                       TokenScores)
from looped_lm.models.db.contexts import CachedContext, DecodeState, WindowContext
from looped_lm.models.db.network import DBNetwork
from looped_lm.models.db.objective import BlockObjective
from looped_lm.sampling import RandomSource, SharedGenerator
from looped_lm.settings import IterationLimits, RowBatch, ScoreSettings


TILT_BELOW = 0.5  # the estimator tilts its starting noise only toward targets a pilot call finds rarer than this


class DiffusionBlocksLM(DBNetwork, BlockwiseTrainable, Scorable, CachedDecoding, FixedShapeBlocks, Iterative):
    def __init__(self, args: DBArgs, state: dict | None = None):
        state = state or {}
        # the blocks this run trains in the order the user listed them (round_robin walks them in that order)
        schedule = BlockSchedule(*noise_partition(args, args.num_blocks, state.get("edges")), args.blocks_to_train,
                                 args.block_sampling, args.block_weights)
        super().__init__(args, schedule)
        self.max_iterations = args.limits.max_iterations
        schedule.freeze_untrained(self.blocks)
        schedule.curve = state.get("curve")
        self.objective = BlockObjective(self, args)

    # --- Trainable ------------------------------------------------------------------------------------

    def training_loss(self, x, y, step: int, seed: int):
        return self.objective.training_loss(x, y, step, seed)

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        """ppl@0's loss: one call at sigma_top from pure noise, one draw (denoising off: the clean readout's)."""
        if not self.args.denoise_weight:
            return self.objective.clean_losses(x, y, self.readout_block()).mean()
        g = torch.Generator(device=x.device).manual_seed(seed)
        return self.score(x, y, ScoreSettings(k_grid=(), draws=1), g)[0].nll.mean()

    def readout_block(self) -> int | None:
        """The block whose clean stream reads the whole model as an ordinary next-token LM (`ppl_clean`): the
        last of the stack (context stacked), or the one block; None where blocks are independent LMs or no
        clean loss trained the head on the clean stream."""
        if not self.args.clean_lm_weight or not (self.stacked or len(self.blocks) == 1):
            return None
        return self.stack_order[-1]

    def restore_state(self, saved: dict) -> None:
        """Blocks and edges must match this config's; a measured CE curve is adopted."""
        self.block_schedule.restore(saved)

    def measure_curve(self, x, y, seed: int) -> dict:
        return self.objective.measure_curve(x, y, seed)

    # --- Iterative --------------------------------------------------------------------------------------

    def iteration_limits(self) -> IterationLimits:
        return self.args.limits

    def sigma_top(self) -> float:
        """Where chains start: a high quantile of block 0's training sigma law (docs/method.md §5)."""
        return top_of_block0(self.train_ranges[0], self.edges, self.args.sample_top_quantile, self.sched)

    def grid(self) -> ChainGrid:
        return ChainGrid(tuple(self.edges), self.sigma_top(), self.args.last_call, self.sched, self.args.extra_calls)

    def initial_noise(self, rows: int, n: int, random: RandomSource, device=None) -> torch.Tensor:
        """z_0 ~ N(0, sigma_top^2 I), (rows, n, d), each row from its own stream."""
        d = self.tok_emb.weight.shape[1]
        return self.sigma_top() * random.normal(torch.arange(rows), (n, d), device or self.tok_emb.weight.device)

    # --- Scorable ---------------------------------------------------------------------------------------

    def _estimates(self, context, y, K: int, settings: ScoreSettings, random, full: bool):
        """`settings.draws` independent estimates of the K-step sampler's p(y) (draws, B, T) float64, each
        the mean of an antithetic pair of chains (starting noise z and -z: the noise's direction persists
        through the chain, and the pair cancels much of its effect); the mean marginal (B, T, V) with
        `full`; the mean iterations (B, T)."""
        B, T = y.shape
        # the sampler at temperature 1 draws at every bridge (docs/method.md §6): a hard or soft bridge is
        # deterministic given z_0, its marginal near one-hot per draw, its perplexity unbounded
        bridge = settings.bridge or "sample"
        estimates, iters, marginal = [], torch.zeros(B, T, dtype=torch.float64, device=y.device), None
        # toward the target's direction, so chains that must pass through y are not rare. Only where y IS rare:
        # on a likely target the reweighting only adds variance, and -log of a noisier estimate is biased upward
        # (measured on near-certain tokens: 0.04 nats at K = 2 and the default draws, none without the tilt,
        # bench/results/depth_synthetic/round3/chain_check). So never at K = 1 (ppl@0: one call, no path to
        # steer), and at K >= 2 only on targets a pilot call (its own noise, so the choice is independent of
        # the estimates and keeps them unbiased) gives less than TILT_BELOW.
        tilt = None
        if settings.tilt and K > 1:
            xi = random.normal(torch.arange(B), (T, self.tok_emb.weight.shape[1]), y.device)
            pilot, _, _ = sampler_probs(context.denoise, self.grid(), 1, self.sigma_top() * xi, y, random,
                                        self.targets, self.target_table, bridge)
            tilt = settings.tilt * self.targets(y) * (pilot < TILT_BELOW)[..., None].to(xi.dtype)
        for _ in range(settings.draws):
            xi = random.normal(torch.arange(B), (T, self.tok_emb.weight.shape[1]), y.device)
            shift, weight = 0.0, 1.0
            if tilt is not None:  # a defensive mixture: half the draws shifted toward y, each reweighted
                shifted = random.uniform(torch.arange(B), T, y.device)[..., None] < 0.5
                shift = shifted * tilt
            pair = 0
            for eps in (shift + xi, shift - xi):
                if tilt is not None:  # N(eps) / (N(eps)/2 + N(eps - tilt)/2)
                    log_ratio = (eps * tilt).sum(-1).double() - (tilt * tilt).sum(-1).double() / 2
                    weight = 2 / (1 + log_ratio.clamp(max=700).exp())
                p, dist, used = sampler_probs(context.denoise, self.grid(), K, self.sigma_top() * eps, y, random,
                                              self.targets, self.target_table, bridge, settings.candidates,
                                              settings.boost, full, settings.exit_rule)
                pair = pair + weight * p / 2
                iters += weight * used / (2 * settings.draws)
                if full:
                    part = (torch.as_tensor(weight, device=y.device).float()[..., None] * dist) / (2 * settings.draws)
                    marginal = part if marginal is None else marginal + part
            estimates.append(pair)
            if settings.progress is not None:
                settings.progress(1)
        return torch.stack(estimates), marginal, iters

    @torch.no_grad()
    def score(self, x, y, settings: ScoreSettings, generator: torch.Generator | None = None) -> dict:
        """{k: TokenScores}: k = 0 is one call at sigma_top (ppl@0); k >= 1 the K = k sampler (ppl@k); and
        "clean", exact, the clean stream's readout (`readout_block`) where the model has one."""
        ks = sorted({0, *settings.k_grid})  # resolved at the boundary (resolve_score_settings)
        context, random = WindowContext(self, x), SharedGenerator(generator)
        out = {}
        if self.readout_block() is not None:
            out["clean"] = TokenScores(self.objective.clean_losses(x, y, self.readout_block()))
        if not self.args.denoise_weight:  # nothing trained the denoiser: its ppl@k are not the model's
            return out
        for k in ks:
            estimates, _, iters = self._estimates(context, y, max(k, 1), settings, random, full=False)
            # the estimates' plain mean is unbiased for p itself (bounded in [0, 2]: always resolvable)
            p_var = estimates.var(0) / len(estimates) if len(estimates) > 1 else None
            out[k] = TokenScores(*jackknife_nll(estimates), p=estimates.mean(0), p_var=p_var)
            if settings.exit_rule is not None:
                settings.stats[k] = float(iters.mean())
        return out

    @torch.no_grad()
    def token_logprobs(self, x, y, settings: ScoreSettings, num_iterations: int, generator=None):
        context, random = WindowContext(self, x), SharedGenerator(generator)
        return self._logprobs(context, y, num_iterations, settings, random)

    def _logprobs(self, context, y, K: int, settings: ScoreSettings, random) -> EstimatedLogprobs:
        """log of the estimated marginal (B, T, V), normalised to sum to 1; at the tokens y, the same
        jackknifed estimate `score` reports (<= 0), so an echo log-prob and `looped_lm eval` agree in
        expectation, with its standard error. Where that se is above `settings.resolve_se` (or there is
        none: one draw), more draws are made for those slots alone, doubling, until it is not or
        `settings.max_draws` in all: the value is always a finite number, the se says how far to trust it.
        (Stopping on the estimate's own spread biases the NLL by a fraction of that se; the draws before
        and after each decision are independent.)"""
        estimates, marginal, _ = self._estimates(context, y, K, settings, random, full=True)
        marginal = marginal.clamp_min(0.0)
        logp = (marginal / marginal.sum(-1, keepdim=True).clamp_min(1e-30)).clamp_min(1e-30).log()
        nll, var = jackknife_nll(estimates)
        var = torch.full_like(nll, float("inf")) if var is None else var  # one draw: no spread, unresolved
        draws, cols, open_estimates = settings.draws, torch.arange(y.shape[1], device=y.device), estimates
        while draws < (settings.max_draws or draws):
            open_ = (var[:, cols] > settings.resolve_se ** 2).any(0)  # slots where some row is unresolved
            if not bool(open_.any()):
                break
            cols, open_estimates = cols[open_], open_estimates[:, :, open_]
            more = min(draws, settings.max_draws - draws)
            sub = context if cols.numel() == y.shape[1] else context.at(cols)
            extra, _, _ = self._estimates(sub, y[:, cols], K, replace(settings, draws=more), random, full=False)
            open_estimates, draws = torch.cat([open_estimates, extra]), draws + more
            nll[:, cols], var[:, cols] = jackknife_nll(open_estimates)
        return EstimatedLogprobs(logp.scatter(-1, y[..., None], (-nll).float()[..., None]), var.sqrt())

    # --- CachedDecoding ---------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> DecodeState:
        if not self.args.denoise_weight:  # generate, serve, export's generate all start here
            raise UserError("this checkpoint trained with diffusion.denoise_weight 0 (the clean next-token loss "
                            "alone): its denoising path is untrained, so it cannot sample; score it with "
                            "`looped_lm eval` (ppl_clean)")
        return DecodeState(self, batch, max_len)

    def reset_rows(self, cache: DecodeState, rows) -> None:
        cache.reset(rows)

    @torch.no_grad()
    def forward_cached(self, idx, cache: DecodeState, rows, batch: RowBatch, want_logits: bool = True):
        """Append idx (R, n) to the rows' histories; -> (R, V) logits of each row's next token after its
        own K-step chain (its iterations per token land in batch.iterations). Without want_logits only
        the prelude runs: the blocks catch up when a chain next calls them."""
        sel = cache.append(self, idx, rows)
        if not want_logits:
            return None
        context = CachedContext(self, cache, sel)
        z = batch.noise if batch.noise is not None else self.initial_noise(len(sel), 1, batch.random, idx.device)
        result = run_chain(context.denoise, self.grid(), batch.settings, z, batch.random, self.targets,
                           self.target_table)
        batch.iterations = result.iterations[:, 0]
        return result.logits[:, 0]

    # --- FixedShapeBlocks -----------------------------------------------------------------------------

    def decode_block_fixed(self, b: int, cache: DecodeState, rows, z, sigma, append: bool = True):
        """append False: block b has cached every token of these rows already (a second call at this token)."""
        return CachedContext(self, cache, rows).block_fixed(b, z, sigma, append)

    def example_slots(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, sigma) as the chain hands them to a block: fp32 (R, 1, d) and (R,)."""
        return torch.zeros(rows, 1, self.tok_emb.weight.shape[1], device=device), torch.ones(rows, device=device)

    def use_block_step(self, cache: DecodeState, step) -> None:
        """Also freezes the inference tables' copies (the head, the targets, the mean row) and keeps them in the
        cache, so a compiled step reads them instead of recomputing them per call (and, among the cache's
        tensors, a CUDA graph finds them at fixed addresses); None thaws them."""
        copies = ((self.head_t, self.head_weight), (self.targets_t, self.tok_emb.weight),
                  (self.mean_row_t, self.tok_emb.weight))
        cache.block_step = step
        cache.frozen_tables = [] if step is None else [c.freeze(table) for c, table in copies]
        if step is None:
            for c, _ in copies:
                c.thaw()

    @torch.no_grad()
    def next_token_logprobs(self, cache: DecodeState, rows, logits, tokens, batch: RowBatch,
                            settings: ScoreSettings) -> EstimatedLogprobs:
        """(R, V) log-probs of each row's next token under its K-step sampler: the marginal, estimated
        (the chain's `logits` are one draw of it, one-hot-like after a read-back), with the se (R,) at
        `tokens`."""
        sel = cache.rows(rows)
        out = torch.empty_like(logits, dtype=torch.float32)
        se = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)
        by_k: dict[int, list[int]] = {}
        for i, s in enumerate(batch.settings):
            by_k.setdefault(s.num_iterations, []).append(i)
        for K, members in by_k.items():
            idx = torch.tensor(members, device=logits.device)
            context = CachedContext(self, cache, sel[idx])
            y = tokens[idx][:, None]
            sub = _SubRandom(batch.random, idx)
            est = self._logprobs(context, y, K, settings, sub)
            out[idx], se[idx] = est.logp[:, 0], est.se[:, 0]
        return EstimatedLogprobs(out, se)


class _SubRandom(RandomSource):
    """Rows 0..n-1 of a sub-batch drawing from the streams of rows `idx` of the full batch."""

    def __init__(self, parent: RandomSource, idx: torch.Tensor):
        self.parent, self.idx = parent, idx

    def uniform(self, rows, n, device):
        return self.parent.uniform(self.idx[rows.to(self.idx.device)], n, device)

    def normal(self, rows, shape, device):
        return self.parent.normal(self.idx[rows.to(self.idx.device)], shape, device)


def build(args: DBArgs, state: dict | None = None) -> DiffusionBlocksLM:
    return DiffusionBlocksLM(args, state)

"""Inference settings: ONE object per request, built and validated once at the boundary, then passed
down unchanged.

    limits = model.iteration_limits()            # None for models without K (gpt)
    settings = resolve_settings(limits, num_iterations=K, bridge=None, sampling=SamplingParams(0.8))

`resolve_settings` is the only place that applies defaults, from the kind's one K rule
(`Kind.iteration_limits`: db_ar / looped_db `diffusion.num_iterations` else the block count; huginn
`model.num_iterations` else its mean recurrence; the bridge: `diffusion.bridge`), and checks K, the bridge
and the exit rule. Each boundary calls it once per request: `looped_lm generate` (cli.py), the server (once per HTTP
request, through `Engine.resolve`, for all its choices), the HF wrapper and the vLLM plugin. The engine
and the models take the resulting `InferenceSettings` and never resolve again.

The other verbs' settings resolve here too: `resolve_score_settings` (eval's K grid, by the same K rule),
`serving_limits` (a server's --default-iterations / --max-iterations) and `resolve_steps` (the
supporting modules' step counts: dit, mdm, vit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from looped_lm.errors import UserError
from looped_lm.fields import BRIDGES, MAX_DRAWS  # noqa: F401 (MAX_DRAWS: the server's flags read it here)
from looped_lm.kinds.base import IterationLimits  # the kind's K rule (Kind.iteration_limits)
from looped_lm.sampling import PLAIN, RandomSource, SamplingParams



@dataclass(frozen=True)
class ExitRule:
    """Adaptive exit of a token's iterations (looped_db): stop once KL(p_k || p_k-1) < kl_threshold,
    or once the argmax has held for `argmax_stable` steps (0 = off)."""

    kl_threshold: float | None = None
    argmax_stable: int = 0
    source: str | None = field(default=None, compare=False)  # the flag or field it came from: errors name it

    @staticmethod
    def parse(threshold: float | None, criterion: str | None,
              names: tuple[str, str] = ("--exit-threshold", "--exit-criterion")) -> "ExitRule | None":
        """`--exit-threshold eps` and/or `--exit-criterion kl:<eps>|argmax-stable:<m>` -> a rule (None = off).
        `names`: what the two are called where they came from (the server: its body fields)."""
        if threshold is None and criterion is None:
            return None
        threshold_name, criterion_name = names
        stable = 0
        if criterion is not None:
            name, _, value = criterion.partition(":")
            if name == "kl":
                try:
                    threshold = float(value)
                except ValueError:
                    raise UserError(f"{criterion_name} kl:<eps> needs a number, got '{criterion}'",
                                    criterion_name) from None
                threshold_name = criterion_name
            elif name == "argmax-stable":
                if not value.isdigit() or int(value) < 1:
                    raise UserError(f"{criterion_name} argmax-stable:<m> needs an integer m >= 1, got '{criterion}'",
                                    criterion_name)
                stable = int(value)
            else:
                raise UserError(f"unknown {criterion_name} '{criterion}' (use kl:<eps> or argmax-stable:<m>)",
                                criterion_name)
        if threshold is not None and not threshold >= 0:
            raise UserError(f"{threshold_name}: exit threshold must be >= 0 (got {threshold})", threshold_name)
        return ExitRule(threshold, stable, threshold_name if criterion is None else criterion_name)


def serving_limits(limits: IterationLimits | None, default_iterations: int | None = None,
                   max_iterations: int | None = None) -> IterationLimits | None:
    """A server's own K default and cap (--default-iterations, --max-iterations), within the model's
    limits: the limits every request of that server is then resolved against."""
    if limits is None:
        if default_iterations is not None or max_iterations is not None:
            raise UserError("--default-iterations and --max-iterations apply to DiffusionBlocks and looped models; "
                            "this model has no K")
        return None
    top = limits.max_iterations
    if max_iterations is not None:
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or not 1 <= max_iterations <= top:
            raise UserError(f"--max-iterations must be in 1..{top} (model.max_iterations); got {max_iterations}")
        top = max_iterations
    default = limits.default_iterations if default_iterations is None else default_iterations
    if isinstance(default, bool) or not isinstance(default, int) or not 1 <= default <= top:
        if default_iterations is None:  # the config's default K (diffusion.num_iterations, B, huginn's recurrence)
            raise UserError(f"the model's default K ({default}) exceeds --max-iterations {top}: "
                            "pass --default-iterations")
        raise UserError(f"--default-iterations {default} is outside 1..{top} (the largest K a request may ask for)")
    return replace(limits, default_iterations=default, max_iterations=top)


@dataclass(frozen=True)
class InferenceSettings:
    """How one request runs. num_iterations / bridge are None for models without them."""

    sampling: SamplingParams = PLAIN
    num_iterations: int | None = None
    bridge: str | None = None
    exit_rule: ExitRule | None = None


def resolve_settings(limits: IterationLimits | None, *, num_iterations: int | None = None,
                     bridge: str | None = None, exit_rule: ExitRule | None = None,
                     sampling: SamplingParams = PLAIN, default_iterations: int | None = None,
                     max_iterations: int | None = None) -> InferenceSettings:
    """Defaults applied, everything checked (UserError with `param`). `default_iterations` and
    `max_iterations`: a server's own default K and cap (a server narrows its limits once instead:
    `serving_limits`)."""
    sampling.validate()
    exit_name = (exit_rule.source if exit_rule is not None else None) or "exit_rule"
    if limits is None:
        for name, param, value in (("num_iterations", "num_iterations", num_iterations), ("bridge", "bridge", bridge),
                                   ("exit_rule", exit_name, exit_rule)):
            if value is not None:
                raise UserError(f"{name} applies to DiffusionBlocks and looped models; this model has no K", param)
        return InferenceSettings(sampling)
    if default_iterations is not None or max_iterations is not None:
        limits = serving_limits(limits, default_iterations, max_iterations)
    top = limits.max_iterations
    K = num_iterations if num_iterations is not None else limits.default_iterations
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= top:
        raise UserError(f"num_iterations must be an integer in 1..{top} (got {K!r})", "num_iterations")
    if limits.default_bridge is None:
        if bridge is not None:
            raise UserError("bridge applies to DiffusionBlocks models; this model has none", "bridge")
    else:
        bridge = bridge or limits.default_bridge
        if bridge not in BRIDGES:
            raise UserError(f"bridge must be one of {', '.join(BRIDGES)} (got {bridge!r})", "bridge")
    if exit_rule is not None and not limits.adaptive_exit:
        raise UserError("adaptive exit needs a DiffusionBlocks model (db_ar, looped_db: a KV cache that does not "
                        "depend on K)", exit_name)
    return InferenceSettings(sampling, K, bridge, exit_rule)


def resolve_score_settings(limits: IterationLimits | None, k_grid: list[int] | tuple[int, ...] | None = None,
                           kind: str | None = None, **kwargs) -> ScoreSettings:
    """`looped_lm eval`'s settings: the K grid by the rule every K follows (1..max_iterations, the bound
    generate and serve apply; DiffusionBlocks models also take 0, ppl@0), one line naming the first bad K;
    no grid: the default K generate and serve use. kind: the model's, for the message; kwargs: the other
    ScoreSettings fields (draws, candidates, ...)."""
    if k_grid is None and limits is not None:
        k_grid = (limits.default_iterations,)
    elif k_grid is not None:
        if limits is None:
            who = f"a {kind} model" if kind else "this model"
            raise UserError(f"--num-iterations applies to DiffusionBlocks and looped models; {who} has no K",
                            "num_iterations")
        low = 0 if limits.default_bridge is not None else 1  # ppl@0 is DiffusionBlocks' (huginn: exact at K >= 1)
        for k in k_grid:
            if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= limits.max_iterations:
                raise UserError(f"--num-iterations {k} is outside {low}..{limits.max_iterations} (this model's "
                                "model.max_iterations, the bound generate and serve apply too)", "num_iterations")
        k_grid = tuple(k_grid)
    return ScoreSettings(k_grid=k_grid, **kwargs).validate()


DIT_SAMPLE_STEPS = 50  # the DiT sampler's default Euler steps (the paper's)


def resolve_steps(requested: int | None, num_blocks: int, configured: int = 0, fallback: int | None = None,
                  what: str = "num_iterations") -> int:
    """A supporting module's inference steps (dit Euler steps, mdm unmasking steps, vit's K): the
    request's, else `configured` (the config's diffusion.sample_steps / num_iterations; 0 = unset), else
    `fallback` (dit: DIT_SAMPLE_STEPS, mdm: the sample's length, vit: B). The one place these defaults
    apply; at least one step per block (fewer would leave a block's interval unvisited)."""
    steps = requested if requested is not None else (configured or fallback)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise UserError(f"{what} must be an integer (got {steps!r})", "num_iterations")
    if steps < num_blocks:
        raise UserError(f"{what} ({steps}) must be >= the number of blocks ({num_blocks}): this module runs at "
                        "least one step per block", "num_iterations")
    return steps


def iterations_note(limits: IterationLimits | None, settings: InferenceSettings) -> str | None:
    """One plain line when a request's K is not the chain the model is meant to run, else None (both are
    allowed; the CLI prints the line, the server returns it in the response's `warning`). K < B skips blocks.
    K above both B and the default K, on a DiffusionBlocks model, was no better than the default on every model
    measured (docs/method.md §5): with the extra calls in block 0 (`diffusion.extra_calls: block0`, the language
    models' default) at most a little worse, with them spread over every block (`spread`) often far worse. So
    such a K is run and told so, with the command that measures it on the user's own model and data."""
    if limits is None or settings.num_iterations is None:
        return None
    k, blocks = settings.num_iterations, limits.num_blocks
    if k < blocks:
        return f"note: num_iterations={k} < {blocks} blocks: {blocks - k} block(s) are skipped"
    usual = max(blocks, limits.default_iterations)
    if k <= usual or limits.default_bridge is None:
        return None
    measure = f"looped_lm eval --num-iterations {usual},{k} reports the mean p of the held-out token per K"
    if blocks == 1:  # one weight-tied core: every call is block 0's
        return (f"note: num_iterations={k} is above the default K = {usual}: the extra denoising calls may make "
                f"predictions worse, not better (measure it: {measure})")
    if limits.extra_calls == "block0":
        return (f"note: num_iterations={k} is above the default K = {usual} ({blocks} blocks): the extra denoising "
                f"calls run in block 0 and have measured no better than K = {usual}, on some models a little worse "
                f"({measure})")
    return (f"note: num_iterations={k} is above the default K = {usual} ({blocks} blocks), with the extra denoising "
            f"calls spread over every block: they may make predictions worse, not better (--set "
            f"diffusion.extra_calls=block0 runs them in block 0; {measure})")


@dataclass
class RowBatch:
    """What `forward_cached` receives for R rows: each row's settings and random stream. `noise`
    (R, n, d) replaces the first draw of the starting state (tests, and reproducing the vLLM backend)."""

    settings: list[InferenceSettings]
    random: RandomSource
    noise: torch.Tensor | None = None
    iterations: torch.Tensor | None = None  # filled by the model: calls each row used (adaptive exit)

    @staticmethod
    def uniform(settings: InferenceSettings, rows: int, random: RandomSource,
                noise: torch.Tensor | None = None) -> "RowBatch":
        return RowBatch([settings] * rows, random, noise)


LOGPROB_MAX_DRAWS = 64  # served log-probs: an unresolved estimate may grow to this many draws (docs/method.md §6)
# served log-probs draw again while a token's se is above this many nats: the Jensen bias of -log(mean) is
# about se^2 / 2, and at 1 nat it measured -0.06 nats per token at K = 8 against plain Monte-Carlo, -0.03 at
# 0.5 (bench/results/logprob_check/)
LOGPROB_RESOLVE_SE = 0.5


@dataclass(frozen=True)
class ScoreSettings:
    """How `Scorable.score` estimates. k_grid: the K values scored, resolved (`resolve_score_settings`:
    the model's default K when none is asked; None only for models without K). draws: independent estimates averaged per target
    (each an antithetic pair of chains; their spread gives the standard error). candidates: first-step tokens enumerated by the
    DiffusionBlocks estimator (plus the target and one draw from the rest). boost: the share of the
    importance-sampling proposal put on the target at later steps. tilt: half the starting noises are
    shifted by tilt * y's target (and reweighted), so paths the noise steers to y are not rare (0 = off).
    bridge: None = the config's. max_draws: log-probs only (`token_logprobs`): where a token's estimate is
    still unresolved after `draws`, draw again for those tokens alone, doubling, up to max_draws in all
    (None: exactly `draws`); the work a request may cost is then at most max_draws / draws times the fixed
    estimate's."""

    k_grid: tuple[int, ...] | None = None
    draws: int = 4
    candidates: int = 2
    boost: float = 0.5
    tilt: float = 1.0
    bridge: str | None = None
    exit_rule: ExitRule | None = None
    max_draws: int | None = None
    resolve_se: float = 1.0  # with max_draws: draw again while a token's se (nats) is above this
    stats: dict = field(default_factory=dict, compare=False)  # filled with mean iterations under exit_rule
    progress: object = field(default=None, compare=False)  # called with 1 after each draw (eval's progress bar)

    def validate(self) -> "ScoreSettings":
        if isinstance(self.draws, bool) or not isinstance(self.draws, int) or not 1 <= self.draws <= MAX_DRAWS:
            raise UserError(f"draws must be an integer in 1..{MAX_DRAWS} (got {self.draws!r})", "draws")
        if self.max_draws is not None and (isinstance(self.max_draws, bool) or not isinstance(self.max_draws, int)
                                           or not self.draws <= self.max_draws <= MAX_DRAWS):
            raise UserError(f"max_draws must be an integer in draws ({self.draws}) .. {MAX_DRAWS} "
                            f"(got {self.max_draws!r})", "max_draws")
        if not self.resolve_se > 0:
            raise UserError(f"resolve_se must be > 0 (got {self.resolve_se})", "resolve_se")
        if self.candidates < 0:
            raise UserError(f"candidates must be >= 0 (got {self.candidates})", "candidates")
        if not 0 <= self.boost < 1:
            raise UserError(f"boost must be in [0, 1) (got {self.boost})", "boost")
        if self.bridge is not None and self.bridge not in BRIDGES:
            raise UserError(f"bridge must be one of {', '.join(BRIDGES)} (got {self.bridge!r})", "bridge")
        for k in self.k_grid or ():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise UserError(f"the K grid must hold integers >= 0 (got {k!r})", "num_iterations")
        return self

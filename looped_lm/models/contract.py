"""The contract between models and everything that calls them (trainer, eval, engine, server, HF, vLLM).

A model kind is a `torch.nn.Module` that subclasses the capabilities it offers; callers ask with
`isinstance(model, Capability)`, never by probing attribute names.

    Trainable        training_loss / validation_loss / step_units / param_unit / checkpoint_state
    Scorable         score(x, y, ScoreSettings, generator) -> {label: TokenScores}      (eval, echo log-probs)
    CachedDecoding   new_cache / forward_cached(idx, cache, rows, RowBatch) -> next-token logits
    FixedShapeDecoding decode_fixed(idx, cache, rows) -> logits: one token per row, static shapes (compiled)
    FixedShapeBlocks decode_block_fixed(b, cache, rows, z, sigma) -> logits: one block call of a K-step
                     chain, static shapes (compiled); use_block_step(cache, step) routes the chain's calls
    Iterative        iteration_limits() -> IterationLimits: the model has a K (DiffusionBlocks, looped)

The supporting modules (vit, dit, mdm) are Trainable, and offer what `eval` / `generate` ask of them:
    Classifier       accuracy(images, labels, K) -> {"accuracy", "examples", "num_iterations"};
                     features(images, K) -> (N, F)                                          (vit)
    ImageGenerator   sample(labels, steps, cfg_scale) -> images; steps_per_block(steps)             (dit)
    TextDiffusion    elbo_bpc(ids) -> {"bpc", "per_block", ...}; sample(n, length, steps) -> ids;
                     steps_per_block(steps)                                                  (mdm)
Their K (inference steps) is at least one per block; a smaller one is a UserError.

Inference settings (K, bridge, exit rule, sampler) are built and validated once per request by
`looped_lm.settings.resolve_settings(model.iteration_limits(), ...)` and passed down unchanged.

Shapes: B batch, T time, R rows of a decode cache, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from looped_lm.errors import UserError
from looped_lm.settings import IterationLimits, RowBatch, ScoreSettings


class Trainable(ABC):
    """What the trainer needs. One micro-batch in, (loss, metrics) out; the optimiser lives outside."""

    @abstractmethod
    def training_loss(self, x: torch.Tensor, y: torch.Tensor, step: int, seed: int) -> tuple[torch.Tensor, dict]:
        """x, y (B, T) token ids (y = x shifted by one) -> (scalar loss, metrics of floats)."""

    @abstractmethod
    def validation_loss(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> torch.Tensor:
        """Held-out loss of one batch (scalar), deterministic for a seed."""

    def step_units(self, step: int, seed: int) -> set[str] | None:
        """Parameter units (see `param_unit`) that step `step` updates; None = all of them. Must depend
        on (step, seed) only, so every rank agrees."""
        return None

    def param_unit(self, name: str) -> str:
        """The unit a parameter belongs to ("shared", "block0", ...): the optimiser's grouping."""
        return "shared"

    def checkpoint_state(self) -> dict:
        """JSON-able model metadata saved in the manifest beside the weights (block edges, ...)."""
        return {}

    def restore_state(self, saved: dict) -> None:
        """Adopt the `checkpoint_state` of a checkpoint being resumed; raise UserError naming what
        differs from this model's own (block count, edges)."""
        if saved != self.checkpoint_state():
            raise UserError(f"cannot resume: the checkpoint's model state {saved} differs from this run's "
                            f"{self.checkpoint_state()}")

    def uses_curve(self) -> bool:
        """Whether the trainer should measure a held-out CE(sigma) curve every `diffusion.curve_every` steps
        (`measure_curve`) and hand it back on every rank (`apply_curve`)."""
        return False

    def measure_curve(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict:
        return {}

    def apply_curve(self, curve: dict) -> None:
        """Models that measure no curve have nothing to adopt."""


@dataclass
class TokenScores:
    """Per-target scores of one window batch: nll (B, T) = -log p(y_t | x_<=t), and, where p is
    estimated, nll_var (B, T): the variance of that estimate (None where p is exact); p (B, T): an unbiased
    estimate of p itself, with p_var its variance (None where p is exact: exp(-nll))."""

    nll: torch.Tensor
    nll_var: torch.Tensor | None = None
    p: torch.Tensor | None = None
    p_var: torch.Tensor | None = None

    def probability(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(p (B, T), its variance or None): the estimate where there is one, else exp(-nll), exact."""
        return (self.p, self.p_var) if self.p is not None else ((-self.nll.double()).exp(), None)


@dataclass
class EstimatedLogprobs:
    """Log-probabilities (B, T, V) estimated by Monte-Carlo (DiffusionBlocks), every one finite and <= 0, with
    se (B, T): the standard error, in nats, of the estimate at the tokens y (None: one draw, no spread)."""

    logp: torch.Tensor
    se: torch.Tensor | None


def split_logprobs(result) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` / `next_token_logprobs` -> (log-probs, standard error or None where exact)."""
    return (result.logp, result.se) if isinstance(result, EstimatedLogprobs) else (result, None)


class Scorable(ABC):
    """What `looped_lm eval` and prompt log-probs need."""

    @abstractmethod
    def score(self, x: torch.Tensor, y: torch.Tensor, settings: ScoreSettings,
              generator: torch.Generator | None = None) -> dict:
        """{label: TokenScores} for targets y (B, T) after inputs x (B, T). Labels: "exact" (gpt), K
        (huginn: exact per K), k (DiffusionBlocks: the K = k sampler's ppl@k; 0 = one call at sigma_top)."""

    @abstractmethod
    def token_logprobs(self, x: torch.Tensor, y: torch.Tensor, settings: ScoreSettings,
                       num_iterations: int | None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Log-probabilities (B, T, V) of the token after each position of x, as the K = num_iterations
        sampler gives them (K resolved by the caller; None only for models without K): what echo log-probs
        report. Exact models return the tensor; DiffusionBlocks
        returns `EstimatedLogprobs`: its marginal, estimated, most precisely for the tokens y (B, T), every
        value finite, with the standard error at y."""


class CachedDecoding(ABC):
    """What `generate`, the engine and the Hugging Face wrapper need: incremental decoding."""

    vocab_size: int
    max_positions: int

    @abstractmethod
    def new_cache(self, batch: int, max_len: int):
        """A decode state for `batch` rows of up to `max_len` tokens each."""

    @abstractmethod
    def forward_cached(self, idx: torch.Tensor, cache, rows: torch.Tensor | None, batch: RowBatch,
                       want_logits: bool = True) -> torch.Tensor | None:
        """Append idx (R, n) to the histories of `rows` (None = all rows) -> logits (R, V) of each row's
        next token, each row run with its own settings and random stream from `batch`. With
        want_logits=False (a prompt chunk that is not the last) only the caches are filled: -> None."""

    @abstractmethod
    def reset_rows(self, cache, rows: torch.Tensor) -> None:
        """Free rows for new sequences."""

    def next_token_logprobs(self, cache, rows: torch.Tensor | None, logits: torch.Tensor, tokens: torch.Tensor,
                            batch: RowBatch, settings: ScoreSettings) -> torch.Tensor:
        """(R, V) log-probs of each row's next token, most precisely of `tokens` (R,), given the `logits`
        `forward_cached` just returned: they ARE the distribution for exact models (this default); a
        DiffusionBlocks chain's logits are one draw of its sampler and it estimates the marginal.
        `batch.random` must be a stream the request's sampling does not use."""
        return logits.float().log_softmax(-1)

    def reserve(self, cache, max_iterations: int | None) -> None:
        """Allocate now what serving up to `max_iterations` will need (caches that grow with K)."""

    def kv_bytes_per_token(self, cache) -> int:
        """Cache bytes one token of history occupies in one row."""
        return cache.nbytes_per_token()


class FixedShapeDecoding(ABC):
    """A decode step whose shapes depend only on the row count and the cache's size, with no host reads:
    what the engine compiles (looped_lm/engine/compiled.py), rows padded to a few bucket sizes."""

    @abstractmethod
    def decode_fixed(self, idx: torch.Tensor, cache, rows: torch.Tensor) -> torch.Tensor:
        """Append one token per row, idx (R, 1), to the histories of `rows` (R,) -> next-token logits (R, V),
        equal to `forward_cached`'s. A row may be listed more than once with the same token (padding)."""


class FixedShapeBlocks(ABC):
    """DiffusionBlocks decoding whose block calls can be compiled: the K-step chain's control (routing,
    bridges, per-row draws, exit rules) stays eager, and each block call for rows that have exactly one
    token that block has not cached (every decode step once a request's blocks run at each token) is a
    static-shape step (looped_lm/engine/compiled.py), rows padded to a few bucket sizes."""

    @abstractmethod
    def decode_block_fixed(self, b: int, cache, rows: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor,
                           append: bool = True) -> torch.Tensor:
        """Block b's call for `rows` (R,) of `cache`, noisy slots z (R, 1, d) at sigma (R,) -> logits (R, 1, V),
        equal to the eager call's; with `append`, each row has one token block b has not cached, which it
        appends (without: none). No host reads. A row may be listed more than once (padding) with the same z
        and sigma."""

    @abstractmethod
    def example_slots(self, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, sigma) of `rows` rows as the chain passes them to `decode_block_fixed` (shapes and dtypes: what
        the engine compiles for)."""

    @abstractmethod
    def use_block_step(self, cache, step) -> None:
        """Run the eligible block calls of chains decoding from `cache` through `step` (`decode_block_fixed`'s
        signature: a compiled copy of it); None: eager again."""


class Iterative(ABC):
    """A model with K iterations per token (DiffusionBlocks denoising steps, or looped recurrences)."""

    @abstractmethod
    def iteration_limits(self) -> IterationLimits:
        """Its default and largest K, block count, default bridge: the input of `resolve_settings`."""


class Classifier(ABC):
    """A classifier of labelled examples (vit): what `looped_lm eval` prints for it."""

    @abstractmethod
    def accuracy(self, images: torch.Tensor, labels: torch.Tensor, num_iterations: int | None = None,
                 batch_size: int = 256, generator: torch.Generator | None = None) -> dict:
        """Top-1 accuracy with K = num_iterations inference steps (None: the model's default) ->
        {"accuracy", "examples", "num_iterations"}."""

    @abstractmethod
    def features(self, images: torch.Tensor, num_iterations: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """(N, F): the representation the prediction is read from (a feature space in which `eval`
        measures the Frechet distance of a generator's images: the project's stand-in for FID)."""


class ImageGenerator(ABC):
    """A (class-conditional) image denoiser (dit): what `looped_lm generate` draws from."""

    num_classes: int  # 0 = unconditional

    @abstractmethod
    def sample(self, labels: torch.Tensor, steps: int | None = None, cfg_scale: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Images (N, C, H, W) in the data's scale for labels (N,), `steps` sampler steps split across
        the blocks, guidance scale `cfg_scale` (None: the model's defaults)."""

    @abstractmethod
    def steps_per_block(self, steps: int) -> list[int]:
        """How many of `steps` sampler steps each block runs (block 0 first)."""


class TextDiffusion(ABC):
    """A diffusion model over character sequences (mdm): a likelihood bound for `eval`, samples for
    `generate`."""

    seq_len: int

    @abstractmethod
    def elbo_bpc(self, x: torch.Tensor, samples_per_block: int = 8, generator: torch.Generator | None = None) -> dict:
        """The negative ELBO of ids x (N, T) in bits per character (an upper bound on the true NLL) ->
        {"bpc", "per_block", "share", ...}: each block's interval's part of it."""

    @abstractmethod
    def sample(self, n: int, length: int, steps: int | None = None, generator: torch.Generator | None = None,
               device=None) -> torch.Tensor:
        """n sequences (n, length) of ids, `steps` denoising steps split across the blocks."""

    @abstractmethod
    def steps_per_block(self, steps: int) -> list[int]:
        """How many of `steps` denoising steps each block runs (block 0 first)."""

"""Turning logits into tokens: greedy, temperature, top-k, top-p, per row, with per-row random streams.

Every row of a batch has its own SamplingParams and draws its own uniforms (see `RandomSource`), so a
row's tokens do not depend on which rows share its batch. A draw is the inverse CDF of the filtered
distribution at that uniform: batched, exact, and safe at numeric extremes (a temperature of 1e-40 is
greedy, a top_p of 5e-324 keeps the top token).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from looped_lm.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def validate(self) -> "SamplingParams":
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0 <= self.temperature < float("inf"):  # also refuses NaN
            raise UserError(f"temperature must be a finite number >= 0 (got {self.temperature})", "temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0 (got {self.top_k})", "top_k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(0.0)
PLAIN = SamplingParams(1.0)  # the model's own distribution: what scores and log-probs describe
# Greedy (temperature 0) is deterministic for every kind: every draw is an argmax, and what is still
# random, a DiffusionBlocks chain's starting noise or Huginn's initial state, comes from this one seed
# instead of the request's (docs/method.md §5).
GREEDY_SEED = 0


# --- random streams --------------------------------------------------------------------------------


class RandomSource(ABC):
    """Uniform and normal draws for the rows of a batch. `rows` index the batch's rows; row r's numbers
    come from its own stream, so they do not depend on the other rows."""

    @abstractmethod
    def uniform(self, rows: torch.Tensor, n: int, device) -> torch.Tensor:
        """(len(rows), n) uniforms in [0, 1)."""

    @abstractmethod
    def normal(self, rows: torch.Tensor, shape: tuple, device) -> torch.Tensor:
        """(len(rows), *shape) standard normals."""


class RowGenerators(RandomSource):
    """One torch.Generator per row (the engine: one per request, seeded by the request)."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    def uniform(self, rows, n, device):
        return torch.stack([torch.rand(n, generator=self.generators[r], device=self.generators[r].device)
                            for r in rows.tolist()]).to(device)

    def normal(self, rows, shape, device):
        return torch.stack([torch.randn(shape, generator=self.generators[r], device=self.generators[r].device)
                            for r in rows.tolist()]).to(device)


class SharedGenerator(RandomSource):
    """One generator for the whole batch (scoring; `generate` of a single prompt)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def uniform(self, rows, n, device):
        return torch.rand(len(rows), n, generator=self.generator, device=device)

    def normal(self, rows, shape, device):
        return torch.randn(len(rows), *shape, generator=self.generator, device=device)


# --- drawing ----------------------------------------------------------------------------------------


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Row-wise temperature, top-k, top-p of logits (R, ..., V) -> probabilities (R, ..., V), fp32.

    Greedy rows (temperature 0) put all mass on their argmax. The top token always survives top-k and
    top-p, and logits are shifted by their maximum before the temperature divides them, so no row is
    ever all -inf or NaN.
    """
    logits = logits.float()
    R, V = logits.shape[0], logits.shape[-1]
    shape = (R,) + (1,) * (logits.dim() - 1)
    temps = torch.tensor([p.temperature for p in params], device=logits.device).view(shape)
    shifted = logits - logits.amax(-1, keepdim=True)  # <= 0, the argmax at exactly 0
    greedy = temps == 0
    scaled = torch.where(greedy, torch.where(shifted == 0, 0.0, float("-inf")), shifted / temps.clamp_min(1e-45))
    scaled = torch.nan_to_num(scaled, nan=float("-inf"), neginf=float("-inf"))  # 0 / tiny stays 0; -x / tiny -> -inf
    top_k = [p.top_k for p in params]
    if any(0 < k < V for k in top_k):
        ks = torch.tensor([k if 0 < k < V else V for k in top_k], device=logits.device).view(shape)
        kth = scaled.sort(-1, descending=True).values.gather(-1, (ks - 1).expand(*scaled.shape[:-1], 1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, dtype=torch.float64, device=logits.device).view(shape)
        sorted_probs, order = probs.sort(-1, descending=True)
        before = (sorted_probs.cumsum(-1) - sorted_probs).double()  # mass ahead of each token
        drop_sorted = before >= ps
        drop_sorted[..., 0] = False  # the top token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs (..., V), uniforms u (...) in [0, 1) -> token ids (...). A token with
    zero probability is never drawn."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # the last token with mass
    return torch.minimum(ids, last)


def argmax(x: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """x.argmax(-1), the first index of the largest (or of a NaN) value. On CPU torch's argmax is not
    vectorised (~1.3 ms for 16 rows of 50257 logits, 5 % of a decode step): there the blocks' maxima
    (`amax`, vectorised) pick the first block holding the largest value, and argmax runs within it only."""
    V = x.shape[-1]
    n = V // chunk
    if x.device.type != "cpu" or n < 4:
        return x.argmax(-1)
    maxima = x[..., :n * chunk].unflatten(-1, (n, chunk)).amax(-1)
    if n * chunk < V:
        maxima = torch.cat([maxima, x[..., n * chunk:].amax(-1, keepdim=True)], dim=-1)
    start = maxima.argmax(-1) * chunk  # argmax: the first block holding the largest value
    window = (start[..., None] + torch.arange(chunk, device=x.device)).clamp(max=V - 1)  # the last block: repeats V - 1
    return start + x.gather(-1, window).argmax(-1)


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], random: RandomSource, rows: torch.Tensor,
              n: int) -> torch.Tensor:
    """logits (R, n, V) or (R, V) with n = 1 -> token ids (R, n) / (R,). Greedy rows take their argmax and
    draw nothing, so a row's stream advances the same whatever rows share its batch."""
    ids = argmax(logits)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        idx = torch.tensor(drawn, device=logits.device)
        part = logits if len(drawn) == len(params) else logits[idx]
        u = random.uniform(rows[idx.to(rows.device)], n, logits.device)
        u = u if logits.dim() == 3 else u[:, 0]
        ids[idx] = draw(filtered_probs(part, [params[i] for i in drawn]), u)
    return ids


def sample(logits: torch.Tensor, params: list[SamplingParams], random: RandomSource,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits (R, V) -> token ids (R,), row r drawn with params[r] from its own stream."""
    R = logits.shape[0]
    rows = torch.arange(R) if rows is None else rows
    return draw_rows(logits, params, random, rows, 1)


class PositionalRandom(RandomSource):
    """Streams keyed by (seed, position) instead of by request: row r (the token after position
    positions[r]) takes its k-th draw from a generator seeded by (seed, position, k). What a backend that
    sees positions but not requests (vLLM) can reproduce for any batching."""

    STRIDE = 1_000_003

    def __init__(self, seed: int, positions: torch.Tensor):
        self.seed, self.positions = seed, [int(p) for p in positions.tolist()]
        self.calls = [0] * len(self.positions)

    def _generator(self, r: int) -> torch.Generator:
        key = ((self.seed * self.STRIDE + self.positions[r]) * 131 + self.calls[r]) % (2 ** 63)
        self.calls[r] += 1
        return torch.Generator().manual_seed(key)

    def uniform(self, rows, n, device):
        return torch.stack([torch.rand(n, generator=self._generator(r)) for r in rows.tolist()]).to(device)

    def normal(self, rows, shape, device):
        return torch.stack([torch.randn(shape, generator=self._generator(r)) for r in rows.tolist()]).to(device)

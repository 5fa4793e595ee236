"""Turning logits into tokens: greedy, temperature, top-k, top-p. Seeded, batched, no hidden state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_lm.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def validate(self) -> "SamplingParams":
        if not self.temperature >= 0:  # also refuses NaN
            raise UserError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise UserError(f"top_p must be in (0, 1] (got {self.top_p})")
        return self


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on logits (N, V); filtered entries become -inf.
    The logits are shifted by their row maximum before the temperature divides them, and the temperature
    is held inside float32's range, so extreme temperatures give a point mass (tiny) or a flat row
    (huge), never inf or NaN; the top token always survives top-p."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / min(max(params.temperature, 1e-45), 3e38)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest number would drop it too
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits (N, V) -> token ids (N,)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits, params).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

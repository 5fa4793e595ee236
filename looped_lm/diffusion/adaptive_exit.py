"""Adaptive exit for K-step inference: stop a row's iterations once its prediction has settled.

Two criteria (method.md §5):
  kl:<eps>             stop when KL(p_k || p_{k-1}) < eps
  argmax-stable:<m>    stop when the argmax has not changed for m consecutive steps
Every (row, slot) exits independently; an exited one keeps the logits of its last step. The clean
stream's KV cache stays exact because it never depends on the number of iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_lm.errors import UserError


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, for logits (..., V) -> (...)."""
    log_p, log_q = logits_p.float().log_softmax(-1), logits_q.float().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@dataclass(frozen=True)
class ExitRule:
    kl_threshold: float | None = None
    argmax_stable: int = 0

    @staticmethod
    def from_options(threshold: float | None, criterion: str | None) -> "ExitRule | None":
        """`--exit-threshold eps` and/or `--exit-criterion argmax-stable:m` -> a rule (None = off)."""
        if threshold is None and criterion is None:
            return None
        if threshold is not None and threshold < 0:
            raise UserError(f"exit threshold must be >= 0 (got {threshold})")
        stable = 0
        if criterion is not None:
            name, _, value = criterion.partition(":")
            if name == "kl":
                try:
                    threshold = float(value)
                except ValueError:
                    raise UserError(f"--exit-criterion kl:<eps> needs a number, got '{criterion}'") from None
                if threshold < 0:
                    raise UserError(f"exit threshold must be >= 0 (got {threshold})")
            elif name == "argmax-stable":
                if not value.isdigit() or int(value) < 1:
                    raise UserError(f"--exit-criterion argmax-stable:<m> needs an integer m >= 1, got '{criterion}'")
                stable = int(value)
            else:
                raise UserError(f"unknown --exit-criterion '{criterion}' (use kl:<eps> or argmax-stable:<m>)")
        return ExitRule(threshold, stable)

    def tracker(self) -> "ExitTracker":
        return ExitTracker(self)


class ExitTracker:
    """Feeds each step's logits (N, n, V) and answers which (row, slot) may stop now: (N, n) bool."""

    def __init__(self, rule: ExitRule):
        self.rule, self.prev, self.same = rule, None, None

    def update(self, logits: torch.Tensor) -> torch.Tensor:
        done = torch.zeros(logits.shape[:-1], dtype=torch.bool, device=logits.device)
        if self.prev is not None:
            if self.rule.kl_threshold is not None:
                done |= kl_divergence(logits, self.prev) < self.rule.kl_threshold
            if self.rule.argmax_stable:
                same = logits.argmax(-1) == self.prev.argmax(-1)
                self.same = torch.where(same, self.same + 1, torch.zeros_like(self.same))
                done |= self.same >= self.rule.argmax_stable
        else:
            self.same = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        self.prev = logits
        return done

"""Adaptive exit for K-step inference: stop a token's iterations once its prediction has settled.

Rules (`looped_lm.settings.ExitRule`, docs/method.md §5): `kl:<eps>` stops when KL(p_k || p_{k-1}) < eps,
`argmax-stable:<m>` when the argmax has not changed for m consecutive steps. Every (row, slot) exits
independently and keeps the logits of its last step; each row may carry its own rule (or none). The
clean stream's KV cache stays exact because it never depends on the number of iterations.
"""

from __future__ import annotations

import torch

from looped_lm.settings import ExitRule


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim, for logits (..., V) -> (...)."""
    log_p, log_q = logits_p.float().log_softmax(-1), logits_q.float().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class ExitTracker:
    """Per-row exit rules over (R, n) slots. `update(rows, logits)` feeds the logits (len(rows), n, V) of
    one step for some rows and answers which of their slots may stop now: (len(rows), n) bool."""

    def __init__(self, rules: list[ExitRule | None], n: int, device):
        R = len(rules)
        self.kl = torch.tensor([r.kl_threshold if r and r.kl_threshold is not None else float("-inf")
                                for r in rules], device=device)[:, None]
        self.stable = torch.tensor([r.argmax_stable if r and r.argmax_stable else 0 for r in rules],
                                   device=device)[:, None]
        self.active = any(r is not None for r in rules)
        self.prev: torch.Tensor | None = None  # (R, n, V): each slot's previous logits
        self.seen = torch.zeros(R, n, dtype=torch.bool, device=device)
        self.same = torch.zeros(R, n, dtype=torch.long, device=device)

    def update(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        done = torch.zeros(logits.shape[:-1], dtype=torch.bool, device=logits.device)
        if not self.active:
            return done
        if self.prev is None:
            self.prev = torch.zeros(self.seen.shape[0], *logits.shape[1:], device=logits.device)
        prev, seen = self.prev[rows], self.seen[rows]
        done |= seen & (kl_divergence(logits, prev) < self.kl[rows])
        same = seen & (logits.argmax(-1) == prev.argmax(-1))
        count = torch.where(same, self.same[rows] + 1, torch.zeros_like(self.same[rows]))
        done |= (self.stable[rows] > 0) & (count >= self.stable[rows])
        self.same[rows], self.prev[rows], self.seen[rows] = count, logits.float(), True
        return done

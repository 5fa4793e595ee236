"""An out-of-tree model kind, written as a user's own package would write one: it imports only
looped_lm's public plugin API (looped_lm.kinds, looped_lm.fields, the model contract) and registers
itself when imported (LOOPED_LM_PLUGINS=bigram_kind, or a `looped_lm.kinds` entry point).

`bigram`: the next token's logits from the current token alone, through a rank-r factorised table.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm.errors import UserError
from looped_lm.fields import field
from looped_lm.kinds import Kind, LanguageModelSection, register
from looped_lm.models.contract import CachedDecoding, Scorable, TokenScores, Trainable


class BigramSection(LanguageModelSection):
    kind: Literal["bigram"] = field("bigram", "bigram: the next token from the current one (a plugin)")
    rank: int = field(16, "rank of the factorised bigram table")


class BigramKind(Kind):
    name, section, builder = "bigram", BigramSection, "bigram_kind:build"
    summary = "a factorised bigram LM (tests/plugins: an out-of-tree kind)"
    capabilities = frozenset({"language_model"})

    def validate(self, cfg) -> None:
        if cfg.model.rank < 1:
            raise UserError(f"model.rank must be >= 1 (got {cfg.model.rank})")


class BigramCache:
    """Nothing to remember but each row's last token: the model has no context beyond it."""

    def __init__(self, batch: int):
        self.last = torch.zeros(batch, dtype=torch.long)

    def nbytes_per_token(self) -> int:
        return 8


class Bigram(nn.Module, Trainable, Scorable, CachedDecoding):
    def __init__(self, vocab_size: int, rank: int, seq_len: int):
        super().__init__()
        self.vocab_size, self.max_positions = vocab_size, seq_len
        self.inp = nn.Embedding(vocab_size, rank)
        self.out = nn.Linear(rank, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(idx))

    def training_loss(self, x, y, step: int, seed: int):
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten()), {}

    @torch.no_grad()
    def validation_loss(self, x, y, seed: int):
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def score(self, x, y, settings, generator=None) -> dict:
        if settings.k_grid:
            raise UserError("a bigram model takes no K (--num-iterations)", "num_iterations")
        nll = F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten(), reduction="none").view_as(y)
        return {"exact": TokenScores(nll)}

    @torch.no_grad()
    def token_logprobs(self, x, y, settings, num_iterations=None, generator=None) -> torch.Tensor:
        return self(x).float().log_softmax(-1)

    def new_cache(self, batch: int, max_len: int) -> BigramCache:
        return BigramCache(batch)

    @torch.no_grad()
    def forward_cached(self, idx, cache: BigramCache, rows=None, batch=None, want_logits: bool = True):
        rows = torch.arange(len(cache.last)) if rows is None else rows
        cache.last[rows] = idx[:, -1]
        return self(idx[:, -1]) if want_logits else None

    def reset_rows(self, cache: BigramCache, rows) -> None:
        cache.last[rows] = 0


def build(cfg, vocab_size: int, state: dict | None = None) -> Bigram:
    return Bigram(vocab_size, cfg.model.rank, cfg.model.seq_len)


register(BigramKind())

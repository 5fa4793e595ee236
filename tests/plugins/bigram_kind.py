"""An out-of-tree model kind, written as a user's own package would write one: it imports only
looped_lm's public plugin API (looped_lm.kinds, looped_lm.fields, the model contract) and registers
itself when imported (LOOPED_LM_PLUGINS=bigram_kind, or a `looped_lm.kinds` entry point).

`bigram`: the next token's logits from the current token alone, through a rank-r factorised table. It
brings its own `diffusion:` option (diffusion.target_noise) and its own data source (data.source alphabet),
without touching the package.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from looped_lm.errors import UserError
from looped_lm.fields import Float, field
from looped_lm.kinds import LANGUAGE_SOURCES, DiffusionSection, Kind, LanguageModelSection, register, resolve
from looped_lm.models.contract import CachedDecoding, Scorable, TokenScores, Trainable


class BigramSection(LanguageModelSection):
    kind: Literal["bigram"] = field("bigram", "bigram: the next token from the current one (a plugin)")
    rank: int = field(16, "rank of the factorised bigram table")


class BigramDiffusion(DiffusionSection):
    target_noise: Float = field(0.0, "share of training targets replaced by a uniformly drawn token (the plugin's own "
                                     "noising of the target)")

    def check(self) -> None:
        if not 0 <= self.target_noise < 1:
            raise UserError(f"diffusion.target_noise must be in [0, 1) (got {self.target_noise})")


class BigramKind(Kind):
    name, section, diffusion, builder = "bigram", BigramSection, BigramDiffusion, "bigram_kind:build"
    summary = "a factorised bigram LM (tests/plugins: an out-of-tree kind)"
    capabilities = frozenset({"language_model"})
    data_sources = {**LANGUAGE_SOURCES, "alphabet": ""}  # its own: a generated corpus, no data.path
    prepare = "bigram_kind:prepare"

    def validate(self, cfg) -> None:
        if cfg.model.rank < 1:
            raise UserError(f"model.rank must be >= 1 (got {cfg.model.rank})")


def prepare(cfg, vocab_size: int) -> str:
    """data.source alphabet: the alphabet, written as a text file and tokenized by the package's own
    pipeline; the other sources: the package's."""
    from pathlib import Path

    tokens = resolve("looped_lm.data.batches:prepare_tokens")
    if cfg.data.source != "alphabet":
        return tokens(cfg, vocab_size)
    text = Path(cfg.data.cache_dir) / "alphabet.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text("\n".join("abcdefghijklmnopqrstuvwxyz " * 40 for _ in range(40)))
    as_files = cfg.model_copy(deep=True)
    as_files.data.source, as_files.data.path = "files", str(text)
    return tokens(as_files, vocab_size)


class BigramCache:
    """Nothing to remember but each row's last token: the model has no context beyond it."""

    def __init__(self, batch: int):
        self.last = torch.zeros(batch, dtype=torch.long)

    def nbytes_per_token(self) -> int:
        return 8


class Bigram(nn.Module, Trainable, Scorable, CachedDecoding):
    def __init__(self, vocab_size: int, rank: int, seq_len: int, target_noise: float = 0.0):
        super().__init__()
        self.vocab_size, self.max_positions, self.target_noise = vocab_size, seq_len, target_noise
        self.inp = nn.Embedding(vocab_size, rank)
        self.out = nn.Linear(rank, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(idx))

    def training_loss(self, x, y, step: int, seed: int):
        if self.target_noise:
            g = torch.Generator(device=y.device).manual_seed(seed + step)
            noisy = torch.rand(y.shape, generator=g, device=y.device) < self.target_noise
            y = torch.where(noisy, torch.randint(self.vocab_size, y.shape, generator=g, device=y.device), y)
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
    return Bigram(vocab_size, cfg.model.rank, cfg.model.seq_len, cfg.diffusion.target_noise)


register(BigramKind())

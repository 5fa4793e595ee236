"""Reading nanoGPT-format token files: random training batches and evaluation windows.

A token file is a flat array of uint16 ids (train.bin / val.bin), read through np.memmap so that a
9-billion-token OpenWebText file costs no memory up front. A vocabulary above 65,536 tokens (Qwen, Gemma)
does not fit uint16: its files are uint32, and the sibling meta.json says so ("dtype"); a file without
meta.json is uint16, as nanoGPT writes it. torch is imported where batches are made:
opening and checking a token file does not need it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator

import numpy as np

from looped_lm.errors import UserError

SNIFF_TOKENS = 1 << 20  # the sanity checks look at this many tokens from the start of the file
TOKEN_DTYPES = ("uint16", "uint32")  # what a token file may hold, narrowest first


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype of TOKEN_DTYPES that holds every id of a `vocab_size` vocabulary."""
    for name in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return name
    raise UserError(f"a vocabulary of {vocab_size} tokens does not fit a token file ({' or '.join(TOKEN_DTYPES)})")


def load_tokens(path: str, vocab_size: int | None = None) -> np.memmap:
    """The tokens of `path` (uint16, or the dtype its sibling meta.json names), memory-mapped read-only,
    after cheap checks that it is a token file of that dtype.

    The checks look at the size and at the first ~1M tokens: a file of wider integers (every second
    token zero), or ids at or above `vocab_size` (or the vocab_size in a sibling meta.json) are refused.
    """
    if not os.path.isfile(path):
        raise UserError(f"data file {path} does not exist")
    size = os.path.getsize(path)
    if size == 0:
        raise UserError(f"data file {path} is empty")
    meta = _sibling_meta(path)
    dtype = np.dtype(_meta_dtype(path, meta))
    if size % dtype.itemsize:
        length = "an odd byte length" if dtype.itemsize == 2 else f"a byte length not a multiple of {dtype.itemsize}"
        raise UserError(f"data file {path} has {length} ({size} bytes): not a {dtype.name} token file")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    head = np.asarray(tokens[:SNIFF_TOKENS])
    if len(head) >= 2048 and not head[1::2].any() and head[0::2].any():
        wider = "32- or 64-bit" if dtype.itemsize == 2 else f"{16 * dtype.itemsize}-bit"
        raise UserError(f"data file {path} looks like {wider} integers (every second {dtype.name} is 0), "
                        f"not {dtype.name} tokens")
    for limit, origin in ((vocab_size, "the model"), (meta.get("vocab_size"), "its meta.json")):
        if limit is not None and int(head.max()) >= limit:
            raise UserError(f"data file {path} holds token id {int(head.max())}, but {origin} has a vocabulary "
                            f"of {limit}: not tokens of this tokenizer")
    return tokens


def _meta_dtype(path: str, meta: dict) -> str:
    """The dtype meta.json names (uint16 without one), checked against its own vocab_size."""
    name = meta.get("dtype", "uint16")
    if name not in TOKEN_DTYPES:
        raise UserError(f"data file {path}: its meta.json says dtype {name}, but token files are "
                        f"{' or '.join(TOKEN_DTYPES)}")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab - 1 > np.iinfo(name).max:
        raise UserError(f"data file {path}: its meta.json says dtype {name}, which cannot hold the ids of its "
                        f"vocab_size {vocab} (that needs {token_dtype(vocab)})")
    return name


def _sibling_meta(path: str) -> dict:
    meta_path = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.json")
    if not os.path.isfile(meta_path):
        return {}  # nanoGPT's own prepare scripts write none
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except ValueError:
        raise UserError(f"{meta_path} is not valid JSON") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path} is not a JSON object")
    return meta


def batch_seed(seed: int, step: int, micro_step: int, rank: int) -> int:
    """A 63-bit generator seed mixing the four numbers through a hash, so nearby tuples are unrelated."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, micro_step, rank), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenStream:
    """One token file, sampled as nanoGPT does (random offsets) but without hidden state.

    A batch is a pure function of (seed, step, micro_step, rank): a run resumed at step s sees exactly the
    batches an uninterrupted run would, and every rank and micro-step draws its own offsets.
    """

    def __init__(self, path: str, seq_len: int, vocab_size: int | None = None):
        self.path = path
        self.seq_len = seq_len
        self.tokens = load_tokens(path, vocab_size)
        self.num_tokens = len(self.tokens)
        if self.num_tokens < seq_len + 1:
            raise UserError(f"data file {path} has {self.num_tokens} tokens, fewer than model.seq_len+1 = {seq_len + 1}")

    def get_batch(self, batch_size: int, seed: int, step: int, micro_step: int, rank: int):
        """(x, y): int64 tensors [batch_size, seq_len] with y[b, t] = x[b, t + 1] in the file.

        Offsets are uniform over every start that leaves room for the shifted targets.
        """
        import torch  # torch: seconds at start-up

        T = self.seq_len
        g = torch.Generator().manual_seed(batch_seed(seed, step, micro_step, rank))
        starts = torch.randint(self.num_tokens - T, (batch_size,), generator=g).tolist()
        rows = np.stack([self.tokens[i : i + T + 1] for i in starts]).astype(np.int64)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())

    def num_blocks(self, block_size: int, stride: int | None = None, max_tokens: int | None = None) -> int:
        """How many windows `iter_blocks` yields with the same arguments."""
        n, stride = self._eval_span(block_size, stride, max_tokens)
        return (n - 1 - block_size) // stride + 1

    def iter_blocks(self, block_size: int, stride: int | None = None, max_tokens: int | None = None
                    ) -> Iterator[tuple]:
        """Evaluation windows (x, y, n_scored) over the first N = min(file, max_tokens) tokens.

        x = tokens[s : s+T] and y = tokens[s+1 : s+T+1] (int64, shape [T]); score only y[-n_scored:].
        Windows start at s = 0, S, 2S, ... while s + T <= N - 1, where T = block_size and S = stride
        (S = T when stride is None). The first window scores all T targets and each later one its last S,
        so every target in tokens[1 : E+1] is scored exactly once, with E = T + (k-1)*S for
        k = (N-1-T)//S + 1 windows; the tail of fewer than S targets is dropped. With S = T (disjoint
        blocks) that is (N-1)//T blocks and (N-1)//T * T targets. With S < T every scored target after
        the first window sees at least T - S tokens of context: the strided-perplexity protocol of the
        Hugging Face perplexity guide.
        """
        import torch  # torch: seconds at start-up

        n, stride = self._eval_span(block_size, stride, max_tokens)
        T = block_size
        for k, s in enumerate(range(0, n - T, stride)):
            window = torch.from_numpy(self.tokens[s : s + T + 1].astype(np.int64))
            yield window[:-1], window[1:], T if k == 0 else stride

    def _eval_span(self, block_size: int, stride: int | None, max_tokens: int | None) -> tuple[int, int]:
        stride = block_size if stride is None else stride
        if block_size < 1 or not 1 <= stride <= block_size:
            raise UserError(f"evaluation stride must be between 1 and block_size = {block_size}, got {stride}")
        n = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if n < block_size + 1:
            limit = "" if max_tokens is None or max_tokens >= self.num_tokens else f" (max_tokens = {max_tokens})"
            raise UserError(f"data file {self.path} has {n} tokens{limit}, fewer than block_size+1 = {block_size + 1}")
        return n, stride

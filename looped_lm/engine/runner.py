"""The model side of the engine: one preallocated KV pool, and the calls a step makes on it.

Every call takes the rows of several requests at once; each row runs with its request's own settings
(K, bridge, sampler) and draws from its own generator (`RowGenerators`), so a request's tokens do not
depend on which requests share its batch. Log-probs come from the model's `next_token_logprobs` /
`token_logprobs`, which for DiffusionBlocks models estimate the K-step sampler's marginal (and draw from a
separate scoring generator, so asking for log-probs never changes the sampled text).
"""

from __future__ import annotations

import math

import torch

from looped_lm.engine import compiled
from looped_lm.engine.requests import TokenLogprob
from looped_lm.engine.scheduler import Sequence
from looped_lm.errors import UserError
from looped_lm.models.contract import CachedDecoding, FixedShapeBlocks, FixedShapeDecoding, Scorable, split_logprobs
from looped_lm.sampling import RowGenerators, sample
from looped_lm.settings import RowBatch, ScoreSettings


def kv_bytes_per_token(model: CachedDecoding, max_iterations: int | None = None) -> int:
    """Bytes one token of one slot occupies in `model.new_cache`, caches that grow with K reserved for
    `max_iterations` (measured on real caches, not modelled)."""
    sizes = []
    for length in (1, 2):
        cache = model.new_cache(1, length)
        model.reserve(cache, max_iterations)
        sizes.append(_tensor_bytes(cache))
    return sizes[1] - sizes[0]


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from a cache object (lists, attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x, seen) for x in obj)
    if hasattr(obj, "__dict__") and not callable(obj):
        return sum(_tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


class ModelRunner:
    def __init__(self, model, num_slots: int, max_len: int, vocab_size: int, max_iterations: int | None,
                 score_settings: ScoreSettings, compile_decode: bool = False):
        """compile_decode: run one-token steps through `CompiledDecode` where the model offers
        `FixedShapeDecoding`, or its chain's block calls through `CompiledBlocks` (`FixedShapeBlocks`);
        others decode eagerly."""
        self.model, self.vocab_size, self.score_settings = model, vocab_size, score_settings
        self.device = next(model.parameters()).device
        self.pool = model.new_cache(num_slots, max_len)
        model.reserve(self.pool, max_iterations)
        self.compiled = self.compiled_blocks = None
        if compile_decode and isinstance(model, (FixedShapeDecoding, FixedShapeBlocks)):
            if isinstance(model, FixedShapeDecoding):
                self.compiled = compiled.CompiledDecode(model, self.pool, num_slots)
                self.compiled.warm_up()  # as vLLM captures its graphs: at start-up, not in a request's first step
            else:  # the model's chain calls it (the pool holds it)
                limits = model.iteration_limits()
                self.compiled_blocks = compiled.CompiledBlocks(model, self.pool, num_slots, limits.num_blocks)
                self.compiled_blocks.warm_up()

    def _rows(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.slot for s in seqs], device=self.device)

    def forward(self, ids: torch.Tensor, seqs: list[Sequence], want_logits: bool = True) -> torch.Tensor | None:
        """New tokens ids (R, n) of the rows of `seqs` -> next-token logits (R, V), fp32 (None when
        `want_logits` is False: a non-final prompt chunk only fills the caches)."""
        if self.compiled is not None and ids.shape[1] == 1 and want_logits:  # a decode step: exact models only
            return self.compiled(ids, self.pool, self._rows(seqs))[:, :self.vocab_size].float()
        batch = RowBatch([s.settings for s in seqs], RowGenerators([s.generator for s in seqs]))
        logits = self.model.forward_cached(ids, self.pool, self._rows(seqs), batch, want_logits=want_logits)
        used = [None] * len(seqs) if batch.iterations is None else batch.iterations.tolist()
        for seq, n in zip(seqs, used):  # calls each row's next token took (adaptive exit: fewer than K)
            seq.iterations = n
        return None if logits is None else logits[:, :self.vocab_size].float()

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list:
        """One token per row (its request's sampler and generator) and, where asked, its log-prob entry."""
        tokens = sample(logits, [s.settings.sampling for s in seqs], RowGenerators([s.generator for s in seqs]))
        want = [i for i, s in enumerate(seqs) if s.request.logprobs is not None]
        entries: list[TokenLogprob | None] = [None] * len(seqs)
        if want:
            idx = torch.tensor(want, device=self.device)
            sub = [seqs[i] for i in want]
            batch = RowBatch([s.settings for s in sub], RowGenerators([s.scoring for s in sub]))
            logp, se = split_logprobs(self.model.next_token_logprobs(self.pool, self._rows(sub), logits[idx],
                                                                     tokens[idx], batch, self.score_settings))
            logp = logp[:, :self.vocab_size]
            for j, i in enumerate(want):
                token = int(tokens[i])
                entries[i] = TokenLogprob(token, _value(logp[j, token]), top_logprobs(logp[j], seqs[i].request.logprobs),
                                          _se(se, j))
        return [(int(t), e) for t, e in zip(tokens.tolist(), entries)]

    def score_prompt(self, seq: Sequence) -> list:
        """Log-probs of every prompt token given the ones before it (entry 0: None)."""
        if not isinstance(self.model, Scorable):
            raise UserError("this model cannot score prompts (echo with logprobs)", "echo")
        prompt, top_n = seq.request.prompt, seq.request.prompt_logprobs
        if len(prompt) == 1:
            return [None]
        x = torch.tensor([prompt[:-1]], device=self.device)
        y = torch.tensor([prompt[1:]], device=self.device)
        logp, se = split_logprobs(self.model.token_logprobs(x, y, self.score_settings, seq.settings.num_iterations,
                                                            generator=seq.scoring))
        logp = logp[0, :, :self.vocab_size].float()
        chosen = [_value(v) for v in logp.gather(1, y[0, :, None])[:, 0]]
        return [None] + [TokenLogprob(t, lp, top_logprobs(logp[i], top_n), _se(se, (0, i)))
                         for i, (t, lp) in enumerate(zip(prompt[1:], chosen))]

    def reset(self, slot: int) -> None:
        self.model.reset_rows(self.pool, torch.tensor([slot], device=self.device))


def _value(logprob: torch.Tensor) -> float:
    """A log-prob for the client: a number <= 0 (models return finite values; an estimate's uncertainty
    travels in its se)."""
    return min(float(logprob), 0.0)


def _se(se: torch.Tensor | None, at) -> float | None:
    """The standard error (nats) of an estimated log-prob; None where it is exact or has no spread."""
    if se is None:
        return None
    value = float(se[at])
    return value if math.isfinite(value) else None


def top_logprobs(logp: torch.Tensor, n: int | None) -> list[tuple[int, float]]:
    """The n most likely tokens."""
    if not n:
        return []
    values, ids = logp.topk(n)
    return [(i, min(v, 0.0)) for i, v in zip(ids.tolist(), values.tolist())]

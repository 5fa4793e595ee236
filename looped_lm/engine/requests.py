"""What goes into the engine and what comes out: token ids only (text is the server's business)."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from looped_lm.sampling import PLAIN, SamplingParams
from looped_lm.settings import ExitRule, InferenceSettings


@dataclass
class Request:
    """One generation. Its settings are `settings`, resolved at the caller's boundary (`engine.resolve`:
    the server does this once per HTTP request); or, for callers without one (tests, benchmarks), the
    loose fields sampling / num_iterations / bridge / exit_rule, which the engine resolves once on arrival.
    Not both."""

    prompt: list[int]
    max_tokens: int = 16  # 0 only with prompt_logprobs (score the prompt, generate nothing)
    sampling: SamplingParams = PLAIN
    seed: int | None = None  # None: a fresh random seed
    num_iterations: int | None = None  # K; None: the engine's default (models without K: leave None)
    stop_token_ids: frozenset[int] = frozenset()  # finish ("stop") after sampling one of these
    logprobs: int | None = None  # each new token's log-prob and its top-N alternatives; None: off
    prompt_logprobs: int | None = None  # the same for every prompt token (echo); None: off
    bridge: str | None = None  # DiffusionBlocks: None = the model's default
    exit_rule: ExitRule | None = None  # adaptive exit (DiffusionBlocks): None = every token runs K steps
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    settings: InferenceSettings | None = None  # resolved settings (K, bridge, exit rule, sampler): used as given

    def __post_init__(self):
        loose = (self.sampling is not PLAIN, self.num_iterations, self.bridge, self.exit_rule)
        if self.settings is not None and any(x not in (None, False) for x in loose):
            raise ValueError("give Request either resolved settings or the loose sampling / num_iterations / "
                             "bridge / exit_rule fields, not both")


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float  # <= 0; for DiffusionBlocks an estimate, whose standard error is `se`
    top: list[tuple[int, float]]  # the N most likely (token id, log-prob) at this position
    se: float | None = None  # nats; None where the log-prob is exact (or one draw gave no spread)


@dataclass
class RequestOutput:
    """A delta: the tokens sampled since the last output of this request."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; entry 0 is None
    finish_reason: str | None = None  # stop | length | abort | error
    num_iterations: int | None = None  # the K used (None for models without K)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """This delta followed by `later`, as one delta."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.request_id, self.token_ids + later.token_ids, logprobs,
                             self.prompt_logprobs or later.prompt_logprobs, later.finish_reason,
                             later.num_iterations, later.error)


@dataclass
class EngineStats:
    num_slots: int
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iterations: int = 0  # sum over generated tokens of the denoising calls that produced it (K, or fewer under
    # an exit rule; 1 for models without K)
    steps: int = 0
    decode_calls: int = 0  # forward_cached calls of decode steps (one per step)
    decoded_rows: int = 0  # rows those calls advanced: decoded_rows / decode_calls = mean batch
    finished: Counter = field(default_factory=Counter)  # by finish reason

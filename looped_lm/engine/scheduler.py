"""Continuous batching bookkeeping: which requests wait, which hold a KV slot, and what runs next.

No tensors here: the engine runs the model, the scheduler only decides. Every engine step:

    decode    every row that holds a sampled token not yet fed to the model, in ONE call (rows carry
              their own K, bridge, sampler and random stream)
    prefill   the next chunk of each admitted prompt, oldest first, within a token budget
    admit     waiting requests take free slots (FIFO); scoring requests (echo with max_tokens = 0:
              one whole-prompt forward, no KV cache) need no slot and run within the same budget

Decode rows go first so running streams keep a steady pace while long prompts prefill in chunks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from looped_lm.engine.requests import Request
from looped_lm.settings import InferenceSettings


@dataclass(eq=False)
class Sequence:
    """One request's state inside the engine."""

    request: Request
    settings: InferenceSettings  # built and validated once, when the request arrived
    generator: torch.Generator  # the request's noise and sampling draws
    scoring: torch.Generator  # log-prob estimates draw from here, so they never change the sampled text
    sink: Callable  # receives each RequestOutput (called on the engine thread)
    seed: int = 0
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens already in the KV cache
    output_ids: list[int] = field(default_factory=list)
    pending: int | None = None  # the last sampled token: the input of the next decode step
    iterations: int | None = None  # denoising calls the last forward took for this row (None: not reported)
    prompt_logprobs: list | None = None  # computed before the first token, sent with it
    finish_reason: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def scoring_only(self) -> bool:
        """Echo with no new token: one whole-prompt forward gives everything, no slot. (A new token, even
        one, is generated the way every request's is: the echo and the plain path give the same token.)"""
        return self.request.prompt_logprobs is not None and self.request.max_tokens == 0

    @property
    def prompt_left(self) -> int:
        return len(self.request.prompt) - self.num_prefilled


@dataclass
class StepPlan:
    score: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to run now)
    decode: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.score or self.prefill or self.decode)


class Scheduler:
    def __init__(self, num_slots: int, prefill_chunk: int, prefill_budget: int):
        if num_slots < 1 or prefill_chunk < 1 or prefill_budget < 1:
            raise ValueError("num_slots, prefill_chunk and prefill_budget must be >= 1")
        self.num_slots, self.prefill_chunk, self.prefill_budget = num_slots, prefill_chunk, prefill_budget
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # slot holders, in admission order

    # --- queue changes ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out (abort): its slot, if it held one, is free again."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self._release(seq)
            return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.free.append(seq.slot)
            self.free.sort(reverse=True)

    # --- what runs next -------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[s for s in self.running.values() if s.pending is not None])
        budget = self.prefill_budget
        for seq in self.running.values():
            if budget <= 0:
                break
            if seq.prompt_left > 0:
                n = min(self.prefill_chunk, seq.prompt_left, budget)
                plan.prefill.append((seq, n))
                budget -= n

        kept = deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if budget <= 0 and plan:  # the budget is spent (an empty plan always takes one request)
                kept.append(seq)
                continue
            if seq.scoring_only:
                plan.score.append(seq)
                budget -= len(seq.request.prompt)
            elif self.free and not kept:  # FIFO among requests that need a slot
                seq.slot = self.free.pop()
                self.running[seq.request_id] = seq
                n = min(self.prefill_chunk, seq.prompt_left, max(budget, 1))
                plan.prefill.append((seq, n))
                budget -= n
            else:
                kept.append(seq)
        self.waiting = kept
        return plan

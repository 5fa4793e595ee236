"""The inference engine: one model, one preallocated KV pool, continuous batching. Token ids only.

    engine = Engine.from_memory_budget(model, kv_memory_gb=1.0)
    engine.start()                                          # steps run on a background thread
    settings = engine.resolve(sampling=SamplingParams(0.8), num_iterations=4, bridge="hard")  # once per request
    async for out in engine.generate(Request(prompt=[5, 6, 7], max_tokens=32, seed=0, settings=settings)):
        out.token_ids, out.logprobs, out.finish_reason     # deltas; closing the iterator aborts

    engine.run([Request(...), ...])                         # or step it on this thread (tests, bench)

Each request has its own K (`num_iterations`), bridge, exit rule, sampling parameters, seed, stop token
ids and max_tokens. Its `InferenceSettings` come resolved (`Request.settings`, from `engine.resolve` at
the caller's boundary: the server resolves once per HTTP request) and are used as they are; a request
that gives the loose fields instead is resolved once, when it arrives (`check`). Requests join and leave at
every step (scheduler.py); every running row decodes in ONE model call per step, whatever its settings
(runner.py); prompts are prefilled in chunks of `prefill_chunk` tokens between decode steps, equal chunks
of several prompts in one call. Text (tokenizer, stop strings, chat template) is the server's business.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import struct
import threading
import weakref
from collections import deque
from typing import AsyncIterator, Callable

import torch

from looped_lm.engine.mailbox import Mailbox
from looped_lm.engine.requests import EngineStats, Request, RequestOutput, TokenLogprob
from looped_lm.engine.runner import ModelRunner, kv_bytes_per_token
from looped_lm.engine.scheduler import Scheduler, Sequence
from looped_lm.errors import UserError
from looped_lm.models.contract import Iterative
from looped_lm.sampling import GREEDY_SEED, PLAIN, SamplingParams
from looped_lm.settings import (LOGPROB_MAX_DRAWS, LOGPROB_RESOLVE_SE, ExitRule, InferenceSettings, IterationLimits,
                               ScoreSettings, resolve_settings, serving_limits)

log = logging.getLogger("looped_lm.engine")

__all__ = ["Engine", "Request", "RequestOutput", "TokenLogprob", "InvalidRequest"]

InvalidRequest = UserError  # a request the engine refuses; `param` names the field (the server answers 400)


def served_limits(model, default_iterations: int | None, max_iterations: int | None) -> IterationLimits | None:
    """The model's iteration limits within a server's --default-iterations / --max-iterations (None: no K)."""
    return serving_limits(model.iteration_limits() if isinstance(model, Iterative) else None,
                          default_iterations, max_iterations)


def scoring_seed(seed: int, prompt: list[int]) -> int:
    """The seed of a request's log-prob estimates: its seed and its prompt, hashed. A client that sends
    one seed with every request (lm-evaluation-harness: 1234) still gets independent estimator noise per
    window, which a corpus score needs (the same noise in every window biases the sum), and the same
    request is still scored the same way."""
    digest = hashlib.blake2b(struct.pack(f"<q{len(prompt)}q", seed % 2 ** 63, *prompt), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2 ** 63


class Engine:
    def __init__(self, model, num_slots: int, max_len: int | None = None, prefill_chunk: int = 512,
                 prefill_budget: int | None = None, default_iterations: int | None = None,
                 max_iterations: int | None = None, vocab_size: int | None = None,
                 score_settings: ScoreSettings = ScoreSettings(max_draws=LOGPROB_MAX_DRAWS,
                                                              resolve_se=LOGPROB_RESOLVE_SE),
                 compile_decode: bool = False):
        """num_slots: rows of the KV pool (concurrent sequences); max_len: tokens per slot (prompt +
        generation, at most model.max_positions); prefill_budget: prompt tokens per step (default:
        one chunk); vocab_size: ids that may be sampled (a model may pad its vocabulary);
        score_settings: how log-probs of DiffusionBlocks models are estimated (draws, candidates, and the
        draws an unresolved one may add: by default every log-prob is resolved or has had 64 draws);
        compile_decode: one-token decode steps through torch.compile, rows padded to buckets (compiled.py),
        for models that offer a fixed-shape step (gpt); the others decode eagerly."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_len = max_len or model.max_positions
        if not 1 <= self.max_len <= model.max_positions:
            raise UserError(f"max_len must be in 1..{model.max_positions} (the model's positions); got {self.max_len}")
        self.vocab_size = vocab_size or model.vocab_size
        # the K every request is resolved against: the model's limits within this server's default and cap
        self.limits = served_limits(model, default_iterations, max_iterations)
        self.max_iterations = self.limits and self.limits.max_iterations
        self.default_iterations = self.limits and self.limits.default_iterations
        self.score_settings = score_settings.validate()
        self.runner = ModelRunner(model, num_slots, self.max_len, self.vocab_size, self.max_iterations,
                                  self.score_settings, compile_decode)
        self.scheduler = Scheduler(num_slots, prefill_chunk, prefill_budget or prefill_chunk)
        self.stats = EngineStats(num_slots)
        self._cond = threading.Condition()
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> Mailbox

    @classmethod
    def from_memory_budget(cls, model, kv_memory_gb: float, max_slots: int = 64, max_len: int | None = None,
                           max_iterations: int | None = None, **kwargs) -> "Engine":
        """As many slots as `kv_memory_gb` GiB of KV cache holds at `max_len` tokens each, at most
        `max_slots`."""
        max_len = max_len or model.max_positions
        limits = served_limits(model, None, max_iterations)
        per_slot = kv_bytes_per_token(model, limits and limits.max_iterations) * max_len
        # a model whose decode state does not grow with the sequence (a recurrent or n-gram one) is bounded
        # by max_slots alone
        slots = min(max_slots, int(kv_memory_gb * 2 ** 30 // per_slot)) if per_slot else max_slots
        if slots < 1:
            raise UserError(f"a KV budget of {kv_memory_gb:.4g} GiB holds no sequence: one slot of {max_len} tokens "
                            f"needs {per_slot / 2 ** 30:.4f} GiB (raise --kv-memory-gb or lower --max-model-len)")
        return cls(model, slots, max_len=max_len, max_iterations=max_iterations, **kwargs)

    @staticmethod
    def context_that_fits(model, kv_memory_gb: float, max_len: int, max_iterations: int | None = None) -> int:
        """The longest sequence (at most `max_len`) one slot of a `kv_memory_gb` GiB KV budget holds."""
        limits = served_limits(model, None, max_iterations)
        per_token = kv_bytes_per_token(model, limits and limits.max_iterations)
        return max_len if not per_token else min(max_len, int(kv_memory_gb * 2 ** 30 // per_token))

    @property
    def pool(self):
        return self.runner.pool

    def resolve(self, *, sampling: SamplingParams = PLAIN, num_iterations: int | None = None,
                bridge: str | None = None, exit_rule: ExitRule | None = None) -> InferenceSettings:
        """A request's settings, resolved once against this engine's limits (its default K and cap): what
        a boundary (the server) calls, then hands to every `Request(settings=...)` of that request."""
        return resolve_settings(self.limits, num_iterations=num_iterations, bridge=bridge, exit_rule=exit_rule,
                                sampling=sampling)

    def _settings(self, request: Request) -> InferenceSettings:
        """The request's resolved settings as given; loose fields (tests, benchmarks) resolved here, once."""
        settings = request.settings
        if settings is None:
            return self.resolve(sampling=request.sampling, num_iterations=request.num_iterations,
                                bridge=request.bridge, exit_rule=request.exit_rule)
        if settings.num_iterations is not None and (self.max_iterations is None
                                                    or settings.num_iterations > self.max_iterations):
            # settings resolved against other limits: the pool is reserved for this engine's K only
            raise InvalidRequest(f"num_iterations must be in 1..{self.max_iterations} on this engine "
                                 f"(got {settings.num_iterations})", "num_iterations")
        return settings

    # --- submitting (any thread) ----------------------------------------------------------------

    def check(self, request: Request) -> InferenceSettings:
        """Refuse what the engine cannot run (UserError naming the field); return the request's settings."""
        prompt, n = request.prompt, request.max_tokens
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("the prompt must hold at least one token", "prompt")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"token id {t!r} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidRequest(f"max_tokens must be an integer >= 0 (got {n!r})", "max_tokens")
        if n == 0 and request.prompt_logprobs is None:
            raise InvalidRequest("max_tokens must be >= 1 (0 only when scoring the prompt, i.e. echo with logprobs)",
                                 "max_tokens")
        if len(prompt) + min(n, 1) > self.max_len:  # the prompt alone leaves no room: blame the prompt
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) is longer than the context of {self.max_len} "
                                 f"tokens{' allows before a new token' if n else ''}", "prompt")
        if len(prompt) + n > self.max_len:
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({n}) exceeds the context of "
                                 f"{self.max_len} tokens", "max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(request, name)
            if value is not None and not 0 <= value <= self.vocab_size:
                raise InvalidRequest(f"{name} must be in 0..{self.vocab_size} (got {value})", name)
        settings = self._settings(request)
        if settings.sampling.top_k > self.vocab_size:
            raise InvalidRequest(f"top_k must be at most the vocabulary size, {self.vocab_size} (0 or -1: off; got "
                                 f"{settings.sampling.top_k})", "top_k")
        return settings

    def add_request(self, request: Request, sink: Callable[[RequestOutput], None]) -> InferenceSettings:
        """Queue a request; `sink` receives its outputs on the engine thread. Returns its settings."""
        settings = self.check(request)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        # temperature 0: nothing depends on the seed (sampling.GREEDY_SEED)
        generator = torch.Generator(device=self.device).manual_seed(
            GREEDY_SEED if settings.sampling.greedy else seed % 2 ** 64)
        scoring = torch.Generator(device=self.device).manual_seed(scoring_seed(seed, request.prompt))
        seq = Sequence(request, settings, generator, scoring, sink, seed=seed)
        with self._cond:
            self._inbox.append(seq)
            self._cond.notify()
        return settings

    def abort(self, request_id: str) -> None:
        """Stop a request and free its slot (a no-op for finished or unknown ids)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Deltas of one request, until it finishes; leaving the loop early aborts it. Outputs that
        pile up while the consumer is busy arrive merged into one delta."""
        if not self.is_alive:
            raise RuntimeError("the engine is not running: call start() first")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        mailbox = self._mailbox(asyncio.get_running_loop())
        self.add_request(request, lambda out: mailbox.put(queue, out))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                while not out.finished and not queue.empty():
                    out = out.merge(queue.get_nowait())
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        with self._cond:
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = Mailbox(loop)
            return box

    def run(self, requests: list[Request]) -> list[RequestOutput]:
        """Run requests to completion on this thread (the background thread must not be running);
        returns one merged output per request."""
        if self._thread is not None:
            raise RuntimeError("the engine runs on its background thread: use generate()")
        outputs: dict[str, RequestOutput] = {}

        def sink(out: RequestOutput) -> None:
            outputs[out.request_id] = outputs[out.request_id].merge(out) if out.request_id in outputs else out

        for r in requests:
            self.add_request(r, sink)
        while self.step():
            pass
        return [outputs[r.request_id] for r in requests]

    # --- state ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self._inbox)

    @property
    def num_free_slots(self) -> int:
        return len(self.scheduler.free)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the background thread ------------------------------------------------------------------

    def start(self) -> "Engine":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="looped_lm-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop the thread; every request still queued or running ends with finish_reason "abort"."""
        thread = self._thread
        if thread is not None:
            with self._cond:
                self._stopping = True
                self._cond.notify()
            thread.join()
            self._thread = None
        self._take_inbox()
        for seq in [*self.scheduler.waiting, *self.scheduler.running.values()]:
            self._finish_early(seq, "abort")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._aborts or self.scheduler.has_work()):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug in a step must not stop the engine: fail what ran, go on
                log.exception("engine step failed; aborting the running requests")
                for seq in [*self.scheduler.running.values()]:
                    self._finish_early(seq, "error", "internal engine error")

    # --- one step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> bool:
        """Take new requests and aborts, run one scheduled step; return whether work remains."""
        self._take_inbox()
        plan = self.scheduler.schedule()
        if plan.decode:
            self._guarded(plan.decode, self._decode, plan.decode)
        for seq in plan.score:
            self._guarded([seq], self._score, seq)
        for rows, n in self._prefill_groups(plan.prefill):
            self._guarded(rows, self._prefill, rows, n)
        if plan:
            self.stats.steps += 1
        return self.scheduler.has_work() or bool(self._inbox or self._aborts)

    def _take_inbox(self) -> None:
        with self._cond:
            new, aborts = list(self._inbox), list(self._aborts)
            self._inbox.clear()
            self._aborts.clear()
        for seq in new:
            self.scheduler.add(seq)
            self.stats.requests += 1
        for request_id in aborts:
            seq = self.scheduler.running.get(request_id) or next(
                (s for s in self.scheduler.waiting if s.request_id == request_id), None)
            if seq is not None:
                self._finish_early(seq, "abort")

    def _guarded(self, seqs: list[Sequence], fn, *args) -> None:
        """Run one model call; if it raises, those requests end with an error and the engine goes on."""
        try:
            fn(*args)
        except Exception as e:
            log.exception("model call failed for %d request(s)", len(seqs))
            for seq in seqs:
                if seq.finish_reason is None:
                    self._finish_early(seq, "error", f"{type(e).__name__}: {e}")

    def _decode(self, rows: list[Sequence]) -> None:
        ids = torch.tensor([[s.pending] for s in rows], device=self.device)
        logits = self.runner.forward(ids, rows)
        self.stats.decode_calls += 1
        self.stats.decoded_rows += len(rows)
        for seq, (token, lp) in zip(rows, self.runner.sample(rows, logits)):
            seq.pending = None
            self._advance(seq, token, lp)

    @staticmethod
    def _prefill_groups(chunks: list[tuple[Sequence, int]]) -> list[tuple[list[Sequence], int]]:
        """Prompt chunks that can share a call: the same length and finality (a burst of equal-length
        prompts prefills in one call, whatever their settings)."""
        groups: dict[tuple, list[Sequence]] = {}
        for seq, n in chunks:
            groups.setdefault((n, n == seq.prompt_left), []).append(seq)
        return [(rows, key[0]) for key, rows in groups.items()]

    def _prefill(self, rows: list[Sequence], n: int) -> None:
        """The next n prompt tokens of each row; after a prompt's last chunk, its first token."""
        for seq in rows:
            if seq.num_prefilled == 0 and seq.request.prompt_logprobs is not None:
                seq.prompt_logprobs = self.runner.score_prompt(seq)
        final = rows[0].prompt_left == n
        ids = torch.tensor([s.request.prompt[s.num_prefilled:s.num_prefilled + n] for s in rows], device=self.device)
        logits = self.runner.forward(ids, rows, want_logits=final)
        for seq in rows:
            seq.num_prefilled += n
        self.stats.prompt_tokens += n * len(rows)
        if final:
            for seq, (token, lp) in zip(rows, self.runner.sample(rows, logits)):
                self._advance(seq, token, lp)

    def _score(self, seq: Sequence) -> None:
        """Echo with max_tokens = 0: one whole-prompt scoring pass gives the prompt log-probs; no KV slot.
        (With a new token the request prefills like any other, so it gets the token generation gives.)"""
        seq.prompt_logprobs = self.runner.score_prompt(seq)
        self.stats.prompt_tokens += len(seq.request.prompt)
        self._emit(seq, RequestOutput(seq.request_id, [], [] if seq.request.logprobs is not None else None,
                                      seq.prompt_logprobs, "length", self._k(seq)))
        self._retire(seq, "length")

    # --- finishing ------------------------------------------------------------------------------

    def _k(self, seq: Sequence) -> int | None:
        return seq.settings.num_iterations

    def _advance(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        """Record a sampled token, send it, and finish the request or queue the token for decoding."""
        request = seq.request
        seq.output_ids.append(token)
        self.stats.generation_tokens += 1
        # the denoising calls this token took (fewer than K under an exit rule), where the model reports them
        self.stats.iterations += seq.iterations or self._k(seq) or 1
        reason = None
        if token in request.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= request.max_tokens:
            reason = "length"
        prompt_logprobs = seq.prompt_logprobs
        seq.prompt_logprobs = None  # sent once, with the first token
        self._emit(seq, RequestOutput(seq.request_id, [token], None if lp is None else [lp], prompt_logprobs,
                                      reason, self._k(seq)))
        if reason is not None:
            self._retire(seq, reason)
        elif seq.finish_reason is None:
            seq.pending = token

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        try:
            seq.sink(out)
        except Exception:  # the consumer is gone (e.g. its event loop closed): stop working for it
            log.warning("cannot deliver output of request %s; aborting it", seq.request_id)
            if seq.finish_reason is None and not out.finished:
                self._retire(seq, "abort")

    def _finish_early(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a request that did not finish by itself (abort, error) and tell its consumer."""
        if seq.finish_reason is not None:
            return
        self._retire(seq, reason)
        self._emit(seq, RequestOutput(seq.request_id, [], None, None, reason, self._k(seq), error))

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free the slot (its rows are reset for the next request)."""
        seq.finish_reason = reason
        seq.pending = None
        self.stats.finished[reason] += 1  # counted before the scheduler lets the engine look idle
        self.scheduler.remove(seq.request_id)
        if seq.slot is not None:
            self.runner.reset(seq.slot)
            seq.slot = None

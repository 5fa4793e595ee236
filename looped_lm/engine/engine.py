"""The inference engine: one model, one preallocated KV pool, continuous batching. Token ids only.

    engine = Engine.from_memory_budget(model, kv_memory_gb=1.0)
    engine.start()                                          # steps run on a background thread
    async for out in engine.generate(Request(prompt=[5, 6, 7], max_tokens=32, seed=0)):
        out.token_ids, out.logprobs, out.finish_reason     # deltas; closing the iterator aborts

    engine.run([Request(...), ...])                         # or step it on this thread (tests, bench)

Each request has its own K (`num_iterations`), sampling parameters, seed, stop token ids and
max_tokens. It draws its noise and its samples from its own torch.Generator, so its tokens do not
depend on which requests share its batch (rows of one KV pool decode together exactly as alone:
tests/test_batched_rows.py). Requests join and leave at every step (scheduler.py); prompts are
prefilled in chunks of `prefill_chunk` tokens between decode steps, equal chunks of several prompts
in one forward. Text (tokenizer, stop strings, chat template) is the server's business.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import uuid
import warnings
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, NamedTuple

import torch

from looped_lm.engine.sampling import SamplingParams, sample
from looped_lm.engine.scheduler import Scheduler, Sequence
from looped_lm.errors import UserError

log = logging.getLogger("looped_lm.engine")


class InvalidRequest(UserError):
    """A request the engine refuses; `param` names the offending field (the server answers 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int = 16  # 0 only with prompt_logprobs (score the prompt, generate nothing)
    sampling: SamplingParams = SamplingParams(1.0)
    seed: int | None = None  # None: a fresh random seed
    num_iterations: int | None = None  # K; None: the engine's default (models without K: leave None)
    stop_token_ids: frozenset[int] = frozenset()  # finish ("stop") after sampling one of these
    logprobs: int | None = None  # each new token's log-prob and its top-N alternatives; None: off
    prompt_logprobs: int | None = None  # the same for every prompt token (echo); None: off
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the N most likely (token id, log-prob) at this position


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
    iterations: int = 0  # sum over generated tokens of the K that produced it (1 for models without K)
    steps: int = 0
    decode_calls: int = 0  # forward_cached calls of decode steps (one per K group)
    decoded_rows: int = 0  # rows those calls advanced: decoded_rows / decode_calls = mean batch
    finished: Counter = field(default_factory=Counter)  # by finish reason


class _Mailbox:
    """Outputs bound for one event loop. The engine thread drops them in; one callback per burst (a step's
    outputs) hands them to their queues, instead of one cross-thread wake-up per output."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    def put(self, queue: asyncio.Queue, out: RequestOutput) -> None:
        with self.lock:
            self.items.append((queue, out))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, out in items:
            queue.put_nowait(out)


def _draws_during_forward(kwargs: dict) -> bool:
    """Does a forward draw more than its starting noise? DiffusionBlocks' `bridge: sample` draws a token
    from every denoising step's logits, from the one generator of the call."""
    return kwargs.get("bridge") == "sample"


# --- sizing the KV pool ------------------------------------------------------------------------


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every tensor reachable from a cache object (lists, attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if hasattr(obj, "__dict__") and not callable(obj):
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


def _preallocate(cache, max_iterations: int | None) -> None:
    """Caches that grow with K (huginn: one per iteration, made on first use) get every K up to the
    largest one served now, so the memory budget holds while serving."""
    if max_iterations and hasattr(cache, "iterations"):
        cache.iterations(max_iterations)


def kv_bytes_per_token(model, max_iterations: int | None = None) -> int:
    """Bytes one token of one slot occupies in `model.new_cache` (measured, not modelled)."""
    sizes = []
    for length in (1, 2):
        cache = model.new_cache(1, length)
        _preallocate(cache, max_iterations)
        sizes.append(tensor_bytes(cache))
    return sizes[1] - sizes[0]


def served_max_iterations(model, max_iterations: int | None) -> int | None:
    """The largest K served: the model's `max_iterations`, or less. None for models without K."""
    if not hasattr(model, "inference_kwargs"):
        if max_iterations is not None:
            raise UserError("--max-iterations applies to DiffusionBlocks and looped models; this model has no K")
        return None
    top = model.max_iterations if max_iterations is None else max_iterations
    if not 1 <= top <= model.max_iterations:
        raise UserError(f"--max-iterations must be in 1..{model.max_iterations} (model.max_iterations); got {top}")
    return top


# --- the engine --------------------------------------------------------------------------------


class Engine:
    def __init__(self, model, num_slots: int, max_len: int | None = None, prefill_chunk: int = 512,
                 prefill_budget: int | None = None, default_iterations: int | None = None,
                 max_iterations: int | None = None, vocab_size: int | None = None):
        """num_slots: rows of the KV pool (concurrent sequences); max_len: tokens per slot (prompt +
        generation, at most model.max_positions); prefill_budget: prompt tokens per step (default:
        one chunk); vocab_size: ids that may be sampled (a model may pad its vocabulary)."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_len = max_len or model.max_positions
        if not 1 <= self.max_len <= model.max_positions:
            raise UserError(f"max_len must be in 1..{model.max_positions} (the model's positions); got {self.max_len}")
        self.vocab_size = vocab_size or model.vocab_size
        self.max_iterations = served_max_iterations(model, max_iterations)
        self.iteration_kwargs = self._iteration_table()
        self.default_iterations = self._default_iterations(default_iterations)
        self.uses_noise = getattr(model, "uses_noise", False)
        self.pool = model.new_cache(num_slots, self.max_len)
        _preallocate(self.pool, self.max_iterations)
        self.per_position, self.noise_dim = self._probe()
        self.scheduler = Scheduler(num_slots, prefill_chunk, prefill_budget or prefill_chunk)
        self.stats = EngineStats(num_slots)
        self._cond = threading.Condition()
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _Mailbox
        self._scratch = torch.Generator(device=self.device)  # draws of discarded chains (non-final chunks)

    @classmethod
    def from_memory_budget(cls, model, kv_memory_gb: float, max_slots: int = 64, max_len: int | None = None,
                           max_iterations: int | None = None, **kwargs) -> "Engine":
        """As many slots as `kv_memory_gb` GiB of KV cache holds at `max_len` tokens each, at most
        `max_slots`."""
        max_len = max_len or model.max_positions
        per_slot = kv_bytes_per_token(model, served_max_iterations(model, max_iterations)) * max_len
        slots = min(max_slots, int(kv_memory_gb * 2 ** 30 // per_slot))
        if slots < 1:
            raise UserError(f"a KV budget of {kv_memory_gb} GiB holds no sequence: one slot of {max_len} tokens "
                            f"needs {per_slot / 2 ** 30:.4f} GiB (raise --kv-memory-gb or lower --max-model-len)")
        return cls(model, slots, max_len=max_len, max_iterations=max_iterations, **kwargs)

    def _iteration_table(self) -> dict[int, dict]:
        """{K: forward_cached kwargs} for every K served; {} for models without K."""
        if self.max_iterations is None:
            return {}
        with warnings.catch_warnings():  # K < B skips blocks: allowed per request, no log line each time
            warnings.simplefilter("ignore")
            return {k: self.model.inference_kwargs(k, None) for k in range(1, self.max_iterations + 1)}

    def _default_iterations(self, k: int | None) -> int | None:
        if self.max_iterations is None:
            if k is not None:
                raise UserError("--default-iterations applies to DiffusionBlocks and looped models; "
                                "this model has no K")
            return None
        if k is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                k = self.model.inference_kwargs(None, None)["num_iterations"]
        if k not in self.iteration_kwargs:
            raise UserError(f"the default K ({k}) must be in 1..{self.max_iterations} (the largest K served)")
        return k

    @torch.no_grad()
    def _probe(self) -> tuple[bool, int]:
        """Does forward_cached return logits for every new position (gpt, huginn) or for the next token
        only (DiffusionBlocks)? Noise then has one row per returned position. And the noise width."""
        kwargs = dict(self.iteration_kwargs.get(self.default_iterations, {}))
        noise_dim = 0
        if self.uses_noise:
            kwargs["generator"] = torch.Generator(device=self.device).manual_seed(0)
            noise_dim = self.model.initial_noise(1, 1, kwargs["generator"], self.device).shape[-1]
        cache = self.model.new_cache(1, 2)
        logits = self.model.forward_cached(torch.zeros(1, 2, dtype=torch.long, device=self.device), cache, **kwargs)
        return logits.shape[1] == 2, noise_dim

    # --- submitting (any thread) ----------------------------------------------------------------

    def check(self, request: Request) -> dict:
        """Refuse what the engine cannot run (InvalidRequest); return the request's model kwargs."""
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
        if len(prompt) + n > self.max_len:
            raise InvalidRequest(f"the prompt ({len(prompt)} tokens) plus max_tokens ({n}) exceeds the context of "
                                 f"{self.max_len} tokens", "max_tokens")
        try:
            request.sampling.validate()
        except UserError as e:
            raise InvalidRequest(str(e), str(e).split()[0]) from None
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(request, name)
            if value is not None and not 0 <= value <= self.vocab_size:
                raise InvalidRequest(f"{name} must be in 0..{self.vocab_size} (got {value})", name)
        k = request.num_iterations
        if not self.iteration_kwargs:
            if k is not None:
                raise InvalidRequest("num_iterations applies to DiffusionBlocks and looped models; this model has "
                                     "no K", "num_iterations")
            return {}
        k = self.default_iterations if k is None else k
        if isinstance(k, bool) or k not in self.iteration_kwargs:
            raise InvalidRequest(f"num_iterations must be an integer in 1..{self.max_iterations} (got {k!r})",
                                 "num_iterations")
        return self.iteration_kwargs[k]

    def add_request(self, request: Request, sink: Callable[[RequestOutput], None]) -> None:
        """Queue a request; `sink` receives its outputs on the engine thread."""
        kwargs = self.check(request)
        seed = secrets.randbits(63) if request.seed is None else request.seed
        generator = torch.Generator(device=self.device).manual_seed(seed % 2 ** 64)
        seq = Sequence(request, kwargs, generator, sink, seed=seed)
        with self._cond:
            self._inbox.append(seq)
            self._cond.notify()

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

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> "_Mailbox":
        with self._cond:
            box = self._mailboxes.get(loop)
            if box is None:
                box = self._mailboxes[loop] = _Mailbox(loop)
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
        for rows in plan.decode:
            self._guarded(rows, self._decode, rows)
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

    def _forward(self, ids: torch.Tensor, seqs: list[Sequence], draw_noise: bool = True) -> torch.Tensor:
        """New tokens ids (R, n) of the rows of `seqs` -> next-token logits (R, V), fp32."""
        kwargs, noise = seqs[0].kwargs, None
        if self.uses_noise:
            width = ids.shape[1] if self.per_position else 1
            if draw_noise:
                noise = torch.cat([self.model.initial_noise(1, width, s.generator, self.device) for s in seqs])
            else:  # a non-final prefill chunk of a next-token-only model: its chain's output is discarded
                noise = torch.zeros(len(seqs), width, self.noise_dim, device=self.device)
            if _draws_during_forward(kwargs):  # one generator per call: each row runs with its own
                return torch.cat([self._call(ids[i:i + 1], [s], noise[i:i + 1],
                                             s.generator if draw_noise else self._scratch)
                                  for i, s in enumerate(seqs)])
        return self._call(ids, seqs, noise, None)

    def _call(self, ids: torch.Tensor, seqs: list[Sequence], noise, generator) -> torch.Tensor:
        extra = {} if noise is None else {"noise": noise}
        if generator is not None:
            extra["generator"] = generator
        if _draws_during_forward(seqs[0].kwargs):  # one row per call: the bridge draws with its sampler
            extra["sampling"] = seqs[0].request.sampling
        rows = torch.tensor([s.slot for s in seqs], device=self.device)
        logits = self.model.forward_cached(ids, self.pool, rows=rows, **seqs[0].kwargs, **extra)
        return logits[:, -1, :self.vocab_size].float()

    def _decode(self, rows: list[Sequence]) -> None:
        ids = torch.tensor([[s.pending] for s in rows], device=self.device)
        logits = self._forward(ids, rows)
        self.stats.decode_calls += 1
        self.stats.decoded_rows += len(rows)
        for seq, (token, lp) in zip(rows, self._sample(rows, logits)):
            seq.pending = None
            self._advance(seq, token, lp)

    @staticmethod
    def _prefill_groups(chunks: list[tuple[Sequence, int]]) -> list[tuple[list[Sequence], int]]:
        """Prompt chunks that can share a forward: the same length, kwargs (K) and finality (a burst of
        equal-length prompts prefills in one call)."""
        groups: dict[tuple, list[Sequence]] = {}
        for seq, n in chunks:
            groups.setdefault((n, seq.group, n == seq.prompt_left), []).append(seq)
        return [(rows, key[0]) for key, rows in groups.items()]

    def _prefill(self, rows: list[Sequence], n: int) -> None:
        """The next n prompt tokens of each row; after a prompt's last chunk, its first token."""
        for seq in rows:
            if seq.num_prefilled == 0 and seq.request.prompt_logprobs is not None:
                scoring = torch.Generator(device=self.device).manual_seed(seq.seed % 2 ** 64)
                seq.prompt_logprobs, _ = self._score_prompt(seq, scoring)
        final = rows[0].prompt_left == n
        ids = torch.tensor([s.request.prompt[s.num_prefilled:s.num_prefilled + n] for s in rows], device=self.device)
        logits = self._forward(ids, rows, draw_noise=final or self.per_position)
        for seq in rows:
            seq.num_prefilled += n
        self.stats.prompt_tokens += n * len(rows)
        if final:
            for seq, (token, lp) in zip(rows, self._sample(rows, logits)):
                self._advance(seq, token, lp)

    def _score(self, seq: Sequence) -> None:
        """Echo with max_tokens <= 1: one whole-prompt forward gives the prompt log-probs and the next
        token's logits; no KV slot."""
        seq.prompt_logprobs, last = self._score_prompt(seq, seq.generator)
        self.stats.prompt_tokens += len(seq.request.prompt)
        if seq.request.max_tokens == 0:
            self._emit(seq, RequestOutput(seq.request_id, [], [] if seq.request.logprobs is not None else None,
                                          seq.prompt_logprobs, "length", self._k(seq)))
            self._retire(seq, "length")
            return
        (token, lp), = self._sample([seq], last[None])
        self._advance(seq, token, lp)

    def _score_prompt(self, seq: Sequence, generator: torch.Generator):
        """Log-probs of every prompt token given the ones before it (entry 0: None), and the logits
        after the last prompt token."""
        prompt, top_n = seq.request.prompt, seq.request.prompt_logprobs
        kwargs = dict(seq.kwargs)
        if self.uses_noise:
            kwargs["generator"] = generator
        idx = torch.tensor([prompt], device=self.device)
        logits = self.model.prompt_logits(idx, **kwargs)[0, :, :self.vocab_size].float()  # (T, V)
        logp = logits[:-1].log_softmax(-1)
        targets = torch.tensor(prompt[1:], device=self.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        tops = self._top(logp, top_n)
        entries = [None] + [TokenLogprob(t, lp, top) for t, lp, top in zip(prompt[1:], chosen, tops)]
        return entries, logits[-1]

    @staticmethod
    def _top(logp: torch.Tensor, n: int) -> list[list[tuple[int, float]]]:
        if not n:
            return [[] for _ in range(logp.shape[0])]
        values, ids = logp.topk(n, dim=-1)
        return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """One token per row, each with its request's parameters and generator (+ its log-prob)."""
        greedy = logits.argmax(-1).tolist()
        want = [s.request.logprobs for s in seqs]
        logp = logits.log_softmax(-1) if any(w is not None for w in want) else None
        out = []
        for i, seq in enumerate(seqs):
            params = seq.request.sampling
            token = greedy[i] if params.temperature == 0 else int(sample(logits[i:i + 1], params, seq.generator)[0])
            lp = None
            if want[i] is not None:
                lp = TokenLogprob(token, float(logp[i, token]), self._top(logp[i:i + 1], want[i])[0])
            out.append((token, lp))
        return out

    # --- finishing ------------------------------------------------------------------------------

    def _k(self, seq: Sequence) -> int | None:
        return seq.kwargs.get("num_iterations")

    def _advance(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        """Record a sampled token, send it, and finish the request or queue the token for decoding."""
        request = seq.request
        seq.output_ids.append(token)
        self.stats.generation_tokens += 1
        self.stats.iterations += self._k(seq) or 1
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
        self.scheduler.remove(seq.request_id)
        if seq.slot is not None:
            self.model.reset_rows(self.pool, torch.tensor([seq.slot], device=self.device))
            seq.slot = None
        self.stats.finished[reason] += 1

"""Request handlers (vLLM's `serving`): check a request, turn its text into engine requests, run them,
and shape the OpenAI response or SSE stream. Routes (api_router.py) only call these.

One engine request per choice: prompt i, sample j of `n` is choice i * n + j, with seed `seed + j`.
Each choice streams through `run_choice`: incremental detokenization, stop strings, log-probs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import jinja2

from looped_lm.data.tokenizer import Tokenizer
from looped_lm.engine.engine import Engine, InvalidRequest, Request
from looped_lm.errors import UserError
from looped_lm.sampling import SamplingParams
from looped_lm.settings import ExitRule, InferenceSettings, iterations_note
from looped_lm.serve import protocol as p
from looped_lm.serve.errors import APIError, log
from looped_lm.serve.metrics import RequestTimer, ServerMetrics
from looped_lm.serve.models import ServedModels
from looped_lm.serve.text import (TURN_STOPS, ChatTemplate, Detokenizer, StopStrings, chat_template, encode,
                                  token_bytes, token_text)

MAX_CHOICES = 256  # prompts x n in one request
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's floor too)


@dataclass
class TokenEntry:
    """One token of a choice, for log-probs: its text starts at `offset` in the choice's text. logprob
    None: the first prompt token only (nothing before it). se: the standard error of an estimated
    log-prob (DiffusionBlocks), None where exact."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    offset: int
    se: float | None = None


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    tokens: list[TokenEntry] = field(default_factory=list)  # filled when log-probs were asked for
    finish_reason: str | None = None
    generated: int = 0  # engine tokens in this delta (usage counts them)

    def extend(self, later: "ChoiceDelta") -> None:
        self.text += later.text
        self.tokens += later.tokens
        self.generated += later.generated
        self.finish_reason = later.finish_reason or self.finish_reason


@dataclass
class Choice:
    """What one choice runs: its engine request and how its text is shaped."""

    index: int
    request: Request
    echo: bool
    logprobs: bool
    stop: list[str]
    settings: InferenceSettings  # the request's, resolved once (`OpenAIServing._settings`): the K reported is the K run


class OpenAIServing:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, models: ServedModels, metrics: ServerMetrics,
                 max_request_work: int | None = None, template: ChatTemplate | None = None):
        self.engine, self.tok, self.models, self.metrics = engine, tokenizer, models, metrics
        self.max_request_work = max_request_work  # token-steps per request (`request_work`); None: unbounded
        self.chat = template or chat_template(tokenizer)  # the model's, --chat-template's, or the plain one
        self.stop_ids = frozenset(tokenizer.specials.stop_ids)  # eos and the end-of-turn tokens
        self._warned: set[int] = set()  # the Ks whose `iterations_note` the log already holds

    # --- /v1/completions -----------------------------------------------------------------------

    async def create_completion(self, req: p.CompletionRequest) -> p.CompletionResponse | AsyncIterator[str]:
        name, k = self.models.resolve(req.model, req.num_iterations)
        settings = self._settings(req, k)
        prompts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise APIError.bad_request("max_tokens must be >= 1 (0 only with echo: score the prompt)", "max_tokens")
        scoring = req.logprobs if req.echo and req.logprobs is not None else (0 if max_tokens == 0 else None)
        choices = self._choices(req, prompts, settings, max_tokens, req.stop or [], echo=req.echo,
                                logprobs=req.logprobs, prompt_logprobs=scoring)
        used_k, warning = settings.num_iterations, self._warning(settings)
        timer = self.metrics.track("completions", used_k)
        usage = p.UsageInfo(prompt_tokens=sum(map(len, prompts)))
        token_str = self._token_str(req.return_tokens_as_token_ids)

        def choice_of(d: ChoiceDelta) -> p.CompletionChoice:
            logprobs = self._completion_logprobs(d.tokens, token_str) if req.logprobs is not None else None
            return p.CompletionChoice(index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason)

        if req.stream:
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def chunk(choices: list, usage_info=None) -> p.CompletionStreamResponse:
                return p.CompletionStreamResponse(id=rid, created=created, model=name, choices=choices,
                                                  usage=usage_info, num_iterations=used_k, warning=warning)

            return self._sse(choices, timer, usage, lambda d: chunk([choice_of(d)]),
                             lambda u: chunk([], u), include_usage=bool(req.stream_options and
                                                                        req.stream_options.include_usage))
        results = await self._collect(choices, timer)
        usage.completion_tokens = sum(r.generated for r in results)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return p.CompletionResponse(model=name, choices=[choice_of(r) for r in results], usage=usage,
                                    num_iterations=used_k, warning=warning)

    def _warning(self, settings: InferenceSettings) -> str | None:
        """The line a response carries when its K is not the model's usual chain (`iterations_note`: K < B
        skips blocks; K above B and the default may be worse), logged the first time each such K is asked."""
        note = iterations_note(self.engine.limits, settings)
        if note and settings.num_iterations not in self._warned:
            self._warned.add(settings.num_iterations)
            log.warning(note)
        return note.removeprefix("note: ") if note else None

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if isinstance(prompt[0], str):
            return [self._encode(text) for text in prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(ids) for ids in prompt]

    def _encode(self, text: str) -> list[int]:
        """A text prompt's ids (its special-token text is those tokens; the post-processor's tokens added, as
        vLLM and transformers encode a completion prompt); the empty text starts from the end-of-text token
        (a document start)."""
        return encode(self.tok, text, add_special_tokens=True) or [self.tok.eot_id]

    def _render(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True) -> str:
        """The conversation through the chat template; a template that refuses it (its raise_exception, or
        any error of the template's own code on these messages) is a 400."""
        try:
            return self.chat.render([{"role": m.role, "content": m.text(), "name": m.name} for m in messages],
                                    add_generation_prompt)
        except jinja2.TemplateError as e:
            raise APIError.bad_request(f"the chat template refuses these messages: {e}", "messages") from None
        except Exception as e:  # the template is the model's code: whatever it raises is about the input
            raise APIError.bad_request(f"the chat template fails on these messages ({type(e).__name__}: {e})",
                                       "messages") from None

    def _completion_logprobs(self, tokens: list[TokenEntry], token_str: Callable[[int], str]) -> p.CompletionLogProbs:
        out = p.CompletionLogProbs()
        for e in tokens:
            out.tokens.append(token_str(e.token_id))
            out.token_logprobs.append(None if e.logprob is None else max(e.logprob, MIN_LOGPROB))
            out.token_logprob_se.append(e.se)
            out.text_offset.append(e.offset)
            if e.top is None:
                out.top_logprobs.append(None)
                continue
            # every token has its own name (token_text), so each entry is one token's one value; the
            # actual token is always listed
            listed = [*e.top, (e.token_id, e.logprob)]
            out.top_logprobs.append({token_str(i): max(lp, MIN_LOGPROB) for i, lp in listed})
        return out

    # --- /v1/chat/completions ------------------------------------------------------------------

    async def create_chat_completion(self, req: p.ChatCompletionRequest
                                     ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        name, k = self.models.resolve(req.model, req.num_iterations)
        settings = self._settings(req, k)
        ids = encode(self.tok, self._render(req.messages)) or [self.tok.eot_id]  # the template writes any BOS
        room = self.engine.max_len - len(ids)
        if room < 1:
            raise APIError.bad_request(f"the conversation ({len(ids)} tokens) leaves no room in the context of "
                                       f"{self.engine.max_len} tokens", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens or self._tokens_that_fit(room, settings, req.n,
                                                                                          bool(req.logprobs))
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        turn_stops = TURN_STOPS if self.chat.plain else ()  # a model's own template ends a turn with a token
        choices = self._choices(req, [ids], settings, max_tokens, [*(req.stop or []), *turn_stops], echo=False,
                                logprobs=top_n, prompt_logprobs=None)
        used_k, warning = settings.num_iterations, self._warning(settings)
        timer = self.metrics.track("chat", used_k)
        usage = p.UsageInfo(prompt_tokens=len(ids))
        token_str = self._token_str(False)

        def logprobs_of(d: ChoiceDelta) -> p.ChatLogprobs | None:
            return self._chat_logprobs(d.tokens, token_str, top_n) if req.logprobs else None

        if req.stream:
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            def chunk(choices: list, usage_info=None) -> p.ChatCompletionStreamResponse:
                return p.ChatCompletionStreamResponse(id=rid, created=created, model=name, choices=choices,
                                                      usage=usage_info, num_iterations=used_k, warning=warning)

            def delta_chunk(d: ChoiceDelta) -> p.ChatCompletionStreamResponse:
                delta = p.DeltaMessage(content=d.text) if (d.text or not d.finish_reason) else p.DeltaMessage()
                return chunk([p.ChatStreamChoice(index=d.index, delta=delta, logprobs=logprobs_of(d),
                                                 finish_reason=d.finish_reason)])

            first = [chunk([p.ChatStreamChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))])
                     for c in choices]
            return self._sse(choices, timer, usage, delta_chunk, lambda u: chunk([], u),
                             include_usage=bool(req.stream_options and req.stream_options.include_usage), first=first)
        results = await self._collect(choices, timer)
        usage.completion_tokens = sum(r.generated for r in results)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return p.ChatCompletionResponse(
            model=name, usage=usage, num_iterations=used_k, warning=warning,
            choices=[p.ChatChoice(index=r.index, message=p.AssistantMessage(content=r.text), logprobs=logprobs_of(r),
                                  finish_reason=r.finish_reason) for r in results])

    def _chat_logprobs(self, tokens: list[TokenEntry], token_str, top_n: int | None) -> p.ChatLogprobs:
        tok = self.tok

        def entry(token_id: int, lp: float, cls=p.TopLogprob, **extra):
            return cls(token=token_str(token_id), logprob=max(lp, MIN_LOGPROB),
                       bytes=list(token_bytes(tok, token_id)), **extra)

        return p.ChatLogprobs(content=[
            entry(e.token_id, e.logprob, p.ChatTokenLogprob, logprob_se=e.se,
                  top_logprobs=[entry(i, lp) for i, lp in (e.top or [])])
            for e in tokens])

    # --- shared: engine requests, running choices ----------------------------------------------

    def _settings(self, req: p.SamplingFields, k: int | None) -> InferenceSettings:
        """The request's inference settings, resolved ONCE (every choice runs them): the sampler, K (the
        body's or the alias's), the bridge and the exit rule, by the rules `looped_lm generate` applies."""
        temperature = 1.0 if req.temperature is None else req.temperature
        top_k = 0 if req.top_k in (None, -1) else req.top_k
        sampling = SamplingParams(temperature, top_k, 1.0 if req.top_p is None else req.top_p)
        try:
            exit_rule = ExitRule.parse(req.exit_threshold, req.exit_criterion,
                                       names=("exit_threshold", "exit_criterion"))
            return self.engine.resolve(sampling=sampling, num_iterations=k, bridge=req.bridge, exit_rule=exit_rule)
        except UserError as e:
            if e.param == "num_iterations" and req.num_iterations is None:  # K came from the NAME@K alias
                raise APIError.bad_request(f"model {req.model}: {e}", "model") from None
            raise APIError.from_invalid(e) from None

    def _choices(self, req: p.SamplingFields, prompts: list[list[int]], settings: InferenceSettings,
                 max_tokens: int, stop: list[str], echo: bool, logprobs: int | None,
                 prompt_logprobs: int | None) -> list[Choice]:
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError.bad_request(f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices per request",
                                       "n")
        work = sum(self.request_work(len(ids), max_tokens, settings, logprobs is not None, prompt_logprobs is not None)
                   for ids in prompts) * req.n
        if self.max_request_work is not None and work > self.max_request_work:
            raise APIError.bad_request(
                f"this request may cost {work:,} token-steps (tokens x K x choices, x the log-prob draws where "
                f"estimated), over this server's --max-request-work of {self.max_request_work:,}: lower max_tokens, "
                "n, num_iterations or the prompts", "max_tokens")
        stop_ids = frozenset() if req.ignore_eos else self.stop_ids
        choices = []
        for i, ids in enumerate(prompts):
            for j in range(req.n):
                request = Request(prompt=ids, max_tokens=max_tokens, seed=None if req.seed is None else req.seed + j,
                                  stop_token_ids=stop_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  settings=settings)
                try:
                    settings = self.engine.check(request)
                except InvalidRequest as e:
                    raise APIError.from_invalid(e) from None
                choices.append(Choice(i * req.n + j, request, echo, logprobs is not None, stop, settings))
        return choices

    def request_work(self, prompt_tokens: int, max_tokens: int, settings: InferenceSettings, logprobs: bool,
                     prompt_logprobs: bool) -> int:
        """The most token-steps (a token position through one denoising step) one choice may cost: max_tokens
        x K to generate; where log-probs are estimated (DiffusionBlocks chains), each scored token costs K
        x the most draws the estimator may make. An exit rule only ever shortens this."""
        k = settings.num_iterations or 1
        estimated = self.engine.limits is not None and self.engine.limits.default_bridge is not None
        per_score = k * ((self.engine.score_settings.max_draws or self.engine.score_settings.draws) if estimated else 1)
        return (max_tokens * k + (max_tokens * per_score if logprobs else 0)
                + (prompt_tokens * per_score if prompt_logprobs else 0))

    def _tokens_that_fit(self, room: int, settings: InferenceSettings, n: int, logprobs: bool) -> int:
        """A chat request without max_tokens: the rest of the context, or as many tokens as the work bound
        allows (its finish reason is then "length")."""
        if self.max_request_work is None:
            return room
        per_token = self.request_work(0, 1, settings, logprobs, False) * n
        fit = min(room, self.max_request_work // per_token)
        if fit < 1:
            raise APIError.bad_request(f"one token of this request costs {per_token:,} token-steps, over this "
                                       f"server's --max-request-work of {self.max_request_work:,}", "n")
        return fit

    async def run_choice(self, choice: Choice) -> AsyncIterator[ChoiceDelta]:
        """Deltas of one choice: text (stop strings applied), log-prob entries, finish reason."""
        detok, stops = Detokenizer(self.tok), StopStrings(choice.stop)
        echo = choice.echo
        async with contextlib.aclosing(self.engine.generate(choice.request)) as outputs:
            async for out in outputs:
                if out.finish_reason == "error":
                    raise APIError(500, f"generation failed: {out.error}", type="server_error")
                if out.finish_reason == "abort":  # not ours: the engine is shutting down
                    raise APIError(503, "the server is shutting down", type="server_error")
                d = ChoiceDelta(choice.index, generated=len(out.token_ids))
                if echo:
                    echo = False
                    scores = out.prompt_logprobs or [None] * len(choice.request.prompt)
                    for token, s in zip(choice.request.prompt, scores):
                        piece, offset = detok.add_with_offset(token)
                        if choice.logprobs:
                            d.tokens.append(TokenEntry(token, s and s.logprob, s and s.top, offset, s and s.se))
                        d.text += piece
                scores = out.logprobs or [None] * len(out.token_ids)
                for token, s in zip(out.token_ids, scores):
                    if out.finish_reason == "stop" and token in choice.request.stop_token_ids:
                        continue  # the end-of-text token ends the text; it is not part of it
                    piece, offset = detok.add_with_offset(token)
                    if choice.logprobs:
                        d.tokens.append(TokenEntry(token, s.logprob, s.top, offset, s.se))
                    sent, hit = stops.push(piece)
                    d.text += sent
                    if hit:
                        d.finish_reason = "stop"
                        yield d
                        return  # leaving the loop aborts the engine request: its slot is free at once
                if out.finished:
                    sent, hit = stops.push(detok.flush())
                    d.text += sent if hit else sent + stops.flush()
                    d.finish_reason = "stop" if hit or out.finish_reason == "stop" else "length"
                yield d

    async def _collect(self, choices: list[Choice], timer: RequestTimer) -> list[ChoiceDelta]:
        async def one(choice: Choice) -> ChoiceDelta:
            total = ChoiceDelta(choice.index)
            async for d in self.run_choice(choice):
                if d.generated:
                    timer.token()
                total.extend(d)
            return total

        tasks = [asyncio.ensure_future(one(c)) for c in choices]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()  # after a failure (or a disconnect) the other choices stop too
        timer.done([r.finish_reason for r in results])
        return results

    async def _sse(self, choices: list[Choice], timer: RequestTimer, usage: p.UsageInfo,
                   chunk_of: Callable[[ChoiceDelta], p.ResponseModel], usage_chunk, include_usage: bool,
                   first: list[p.ResponseModel] = ()) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice delta, then usage (if asked for), then [DONE].
        A failure after the stream began is sent as an error event."""
        reasons = []
        try:
            for c in first:
                yield _event(c)
            async for d in _merge([self.run_choice(c) for c in choices]):
                if d.generated:
                    timer.token()
                usage.completion_tokens += d.generated
                if d.finish_reason:
                    reasons.append(d.finish_reason)
                yield _event(chunk_of(d))
            if include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield _event(usage_chunk(usage))
        except APIError as e:
            yield _event(e.body())
        timer.done(reasons)
        yield "data: [DONE]\n\n"

    def _check_model(self, name: str | None) -> None:
        if name is not None:
            self.models.resolve(name, None)

    def _token_str(self, as_ids: bool) -> Callable[[int], str]:
        if as_ids:
            return lambda i: f"token_id:{i}"
        return lambda i: token_text(self.tok, i)

    # --- tokenizer endpoints -------------------------------------------------------------------

    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        self._check_model(req.model)
        chat = req.messages is not None
        text = self._render(req.messages, req.add_generation_prompt) if chat else req.prompt
        add = not chat if req.add_special_tokens is None else req.add_special_tokens  # vLLM's defaults
        ids = encode(self.tok, text, add_special_tokens=add)
        return p.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_len, tokens=ids,
                                  token_strs=[self.tok.decode([i]) for i in ids] if req.return_token_strs else None)

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self._check_model(req.model)
        try:
            return p.DetokenizeResponse(prompt=self.tok.decode(req.tokens))
        except UserError as e:
            raise APIError.bad_request(str(e), "tokens") from None

    def tokenizer_info(self) -> p.TokenizerInfo:
        s = self.tok.specials
        return p.TokenizerInfo(tokenizer_class=s.tokenizer_class, name=self.tok.name, vocab_size=self.tok.vocab_size,
                               model_max_length=self.engine.max_len, eos_token=s.eos_token, eos_token_id=s.eos_token_id,
                               bos_token=s.bos_token, bos_token_id=s.bos_token_id, pad_token=s.pad_token,
                               pad_token_id=s.pad_token_id, unk_token=s.unk_token, unk_token_id=s.unk_token_id,
                               stop_token_ids=sorted(self.stop_ids), chat_template=self.chat.source)

    def health(self) -> p.HealthResponse:
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running", type="server_error")
        return p.HealthResponse()


def _event(model: p.ResponseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _merge(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Items of several async iterators as they come. Closing this closes them all (each then aborts its
    engine request)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with contextlib.aclosing(stream) as s:
                async for item in s:
                    queue.put_nowait(item)
        except Exception as e:  # handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""Routes (vLLM's `api_router`): each one takes the parsed body and calls its handler in serving.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from looped_lm.serve import protocol as p
from looped_lm.serve.serving import OpenAIServing

router = APIRouter()
ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 401, 404)}
# With "stream": true the answer is server-sent events (the schema describes one event, as OpenAPI 3.1
# reads it): `data: <a chunk's JSON>` events, then `data: [DONE]`.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
STREAMED = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/v1/models", response_model=p.ModelList, responses=ERRORS)
async def list_models(request: Request):
    return serving(request).models.cards()


@router.post("/v1/completions", response_model=p.CompletionResponse, responses=STREAMED)
async def create_completion(body: p.CompletionRequest, request: Request):
    return await _respond(request, serving(request).create_completion(body))


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMED)
async def create_chat_completion(body: p.ChatCompletionRequest, request: Request):
    return await _respond(request, serving(request).create_chat_completion(body))


@router.post("/tokenize", response_model=p.TokenizeResponse, responses=ERRORS)
async def tokenize(body: p.TokenizeRequest, request: Request):
    return serving(request).tokenize(body)


@router.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERRORS)
async def detokenize(body: p.DetokenizeRequest, request: Request):
    return serving(request).detokenize(body)


@router.get("/tokenizer_info", response_model=p.TokenizerInfo)
async def tokenizer_info(request: Request):
    return serving(request).tokenizer_info()


@router.get("/health", response_model=p.HealthResponse, responses={503: {"model": p.ErrorResponse}})
async def health(request: Request):
    return serving(request).health()


@router.get("/metrics", response_class=Response)
async def metrics(request: Request):
    return Response(serving(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _respond(request: Request, handler):
    """Run a handler; if the client disconnects first, cancel it (its engine requests are aborted).
    An SSE stream comes back as an async iterator and is sent as text/event-stream."""
    task = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    result = task.result()
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return result


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

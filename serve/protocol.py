"""The OpenAI-compatible wire format: pydantic request and response types (vLLM's `protocol`).

Requests are strict (a string where a number belongs is a 400, not a silent conversion) and ignore
unknown fields, as OpenAI clients send fields a server may not know. Extensions beyond OpenAI's
surface are marked; the main one is `num_iterations` (K), on requests and on responses, with the
chain's `bridge` and the adaptive exit (`exit_threshold`, `exit_criterion`): the CLI's `--num-iterations`,
`--bridge`, `--exit-threshold`, `--exit-criterion`, resolved by the same `looped_lm.settings`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from looped_lm.errors import UserError
from looped_lm.fields import Bridge
from looped_lm.settings import ExitRule

MAX_LOGPROBS = 20
MAX_N = 64


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class FieldError(ValueError):
    """A check on a whole request that is about one field: the 400 names `field` (errors.py). Checks
    of one field are field validators, which pydantic locates by itself."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- errors ------------------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error envelope: every non-2xx answer of this server has this body."""

    error: ErrorInfo


# --- shared request fields ---------------------------------------------------------------------


def _integral(value):
    """JSON (and JSON Schema's `integer`) does not tell 5 from 5.0: take 5.0 as 5. "5", true and 5.5 stay
    refused by the strict int check that follows."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JSONInt = BeforeValidator(_integral)  # after any Field(...) in Annotated[int, ...], so the schema keeps its bounds
TokenId = Annotated[int, Field(ge=0), JSONInt]
Seed = Annotated[int, Field(ge=-(2 ** 63), lt=2 ** 64), JSONInt]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Stop = Union[str, Annotated[list[str], Field(max_length=16)], None]


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="a name from /v1/models (NAME or NAME@K); default: the served model")
    temperature: Temperature | None = Field(None, description="0 = greedy; default 1")
    top_p: TopP | None = Field(None, description="nucleus mass in (0, 1]; default 1 (off)")
    top_k: Annotated[int, Field(ge=-1), JSONInt] | None = Field(None, description="extension: keep the k most likely; "
                                                                        "0 or -1 = off")
    n: Annotated[int, Field(ge=1, le=MAX_N), JSONInt] = 1
    stop: Stop = Field(None, description="up to 16 strings; the text stops before the first one")
    seed: Seed | None = Field(None, description="choice i samples with seed + i; default: random")
    stream: bool = False
    stream_options: StreamOptions | None = None
    num_iterations: Annotated[int, Field(ge=1), JSONInt] | None = Field(
        None, description="extension: K denoising iterations per token (DiffusionBlocks / looped models); "
                          "default: the NAME@K alias, else the server default")
    bridge: Bridge | None = Field(
        None, description="extension (DiffusionBlocks): logits -> denoised point between the K steps: soft "
                          "(expected target), hard (argmax), sample (a token drawn with this request's sampler); "
                          "default: the model's diffusion.bridge")
    exit_threshold: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = Field(
        None, description="extension (looped_db): adaptive exit, a token stops iterating once "
                          "KL(p_k || p_k-1) < this (as `generate --exit-threshold`); default: off")
    exit_criterion: str | None = Field(
        None, json_schema_extra={"pattern": r"^(kl:\S+|argmax-stable:\d+)$"},  # checked by _exit_criterion
        description="extension (looped_db): adaptive exit as `kl:<eps>` or `argmax-stable:<m>` (a token stops "
                    "once its argmax held m steps), as `generate --exit-criterion`; default: off")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-text token")
    user: str | None = None
    # OpenAI fields this server does not implement: accepted at their neutral values only, and left out
    # of the OpenAPI document (which lists what the server does)
    presence_penalty: SkipJsonSchema[float] = 0.0
    frequency_penalty: SkipJsonSchema[float] = 0.0
    logit_bias: SkipJsonSchema[dict[str, float] | None] = None

    # Checks are field validators (not model validators) so that a 400 names its field in `param`.
    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value):
        """One message for the field as the client sent it (the union's own errors name its branches:
        `stop.str`, `stop.list[str]`)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a string or a list of strings (got {type(value).__name__}"
                             f"{'' if not isinstance(value, list) else ' holding a non-string'})")
        if len(value) > 16:
            raise ValueError(f"at most 16 strings (got {len(value)})")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("not supported by this server (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("not supported by this server")
        return value

    @field_validator("exit_criterion")
    @classmethod
    def _exit_criterion(cls, value):
        if value is not None:  # the CLI's parser, so both refuse the same rules
            try:
                ExitRule.parse(None, value, names=("exit_threshold", "exit_criterion"))
            except UserError as e:
                raise ValueError(str(e).removeprefix("exit_criterion: ")) from None
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and "" in stops:
            raise ValueError("stop strings must not be empty")
        return stops


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# --- /v1/completions ---------------------------------------------------------------------------


def _token_ids(x) -> list[int] | None:
    """`x` as a non-empty list of token ids (5.0 taken as 5), or None if it is not one."""
    if not isinstance(x, list) or not x:
        return None
    x = [_integral(t) for t in x]
    return x if all(isinstance(t, int) and not isinstance(t, bool) for t in x) else None


def _check_prompt(value):
    """One clear message for every malformed prompt, instead of one per member of the union."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(x, str) for x in value)):
        return value
    ids = _token_ids(value)
    if ids is None and isinstance(value, list) and value:
        rows = [_token_ids(x) for x in value]
        ids = rows if all(r is not None for r in rows) else None
    if ids is None:
        raise ValueError("must be a string, a non-empty list of strings, a non-empty list of token ids, "
                         "or a non-empty list of non-empty token-id lists")
    negative = [t for t in (ids if isinstance(ids[0], int) else [t for row in ids for t in row]) if t < 0]
    if negative:
        raise ValueError(f"token ids are >= 0 (got {negative[0]})")
    return ids


Prompt = Annotated[Union[str, list[str], list[TokenId], list[list[TokenId]]], BeforeValidator(_check_prompt)]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(..., description="a string, a list of strings, a token-id list, or a list of token-id lists")
    max_tokens: Annotated[int, Field(ge=0), JSONInt] | None = Field(16, description="0 only with echo (score the prompt)")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = Field(
        None, description="log-probs of each token and of the N most likely alternatives")
    echo: bool = Field(False, description="return the prompt before the completion (with logprobs: its log-probs)")
    return_tokens_as_token_ids: bool = Field(False, description="extension (vLLM): tokens read 'token_id:N'")
    best_of: SkipJsonSchema[int | None] = None  # not implemented: neutral values only (best_of == n)
    suffix: SkipJsonSchema[str | None] = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("not supported by this server (only best_of == n)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("not supported by this server")
        return value


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(
        default_factory=list, description="a number <= 0 for every token; null only for the first prompt token of an echo")
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    token_logprob_se: list[float | None] = Field(
        default_factory=list, description="extension: the standard error (nats) of each estimated log-prob "
        "(DiffusionBlocks models estimate them by Monte-Carlo); null where the value is exact")


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    num_iterations: int | None = Field(None, description="extension: the K that produced this response")
    warning: str | None = Field(None, description="extension: set when that K is not the model's usual chain "
                                                 "(K < B skips blocks; K above B and the default may be worse)")


class CompletionStreamResponse(CompletionResponse):
    """One SSE event of a streamed completion (OpenAI reuses the `text_completion` object)."""


# --- /v1/chat/completions ----------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={  # what _top_needs_logprobs checks, for the OpenAPI document
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1), JSONInt] | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: Annotated[int, Field(ge=1), JSONInt] | None = Field(None, description="OpenAI's newer max_tokens")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), JSONInt] | None = None
    # OpenAI fields this server does not implement: accepted when absent or neutral only, undocumented
    tools: SkipJsonSchema[list[Any] | None] = None
    functions: SkipJsonSchema[list[Any] | None] = None
    tool_choice: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    response_format: SkipJsonSchema[Any] = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_max(cls, value, info: ValidationInfo):
        given = info.data.get("max_tokens")
        if value is not None and given is not None and value != given:
            raise ValueError(f"differs from max_tokens ({value} != {given}): give one of them")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info: ValidationInfo):
        if value and not info.data.get("logprobs", True):  # logprobs itself invalid: its own error
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("not supported by this server (no tool calls)")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value):
        if value not in (None, "none", "auto"):
            raise ValueError("not supported by this server (no tool calls; only \"none\" or \"auto\")")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value):
        if value not in (None, {"type": "text"}):
            raise ValueError('not supported by this server (only {"type": "text"})')
        return value


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)
    logprob_se: float | None = Field(None, description="extension: the standard error (nats) of an estimated "
                                     "log-prob (DiffusionBlocks models); null where the value is exact")


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    num_iterations: int | None = Field(None, description="extension: the K that produced this response")
    warning: str | None = Field(None, description="extension: set when that K is not the model's usual chain "
                                                 "(K < B skips blocks; K above B and the default may be worse)")


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    num_iterations: int | None = None
    warning: str | None = None


# --- /v1/models ----------------------------------------------------------------------------------


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "looped_lm"
    root: str
    parent: str | None = None
    max_model_len: int
    num_iterations: int | None = Field(None, description="extension: the K this name fixes (aliases NAME@K)")
    num_blocks: int | None = Field(None, description="extension: B, the blocks of a DiffusionBlocks model (K = B is the trained chain)")


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- tokenizer endpoints (vLLM's extras) -------------------------------------------------------------


class TokenizeRequest(RequestModel):
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: str | SkipJsonSchema[None] = Field(None, description="the text to tokenize (or give messages)")
    messages: list[ChatMessage] | SkipJsonSchema[None] = Field(
        None, description="a conversation, rendered by the chat template (or give prompt)")
    add_special_tokens: bool | None = Field(
        None, description="add what the tokenizer's post-processor adds (a BOS for some models), as transformers' "
                          "encode; default: true for prompt, false for messages (the chat template writes them), "
                          "as vLLM")
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("prompt", "messages", mode="before")
    @classmethod
    def _absent_not_null(cls, value):
        if value is None:  # only given values reach this: a missing field keeps its default silently
            raise ValueError("leave the field out instead of null")
        return value

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("messages" if self.prompt is not None else "prompt",
                             "give exactly one of prompt or messages")
        return self


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str


class TokenizerInfo(ResponseModel):
    tokenizer_class: str
    name: str
    vocab_size: int
    model_max_length: int
    eos_token: str
    eos_token_id: int
    bos_token: str | None = None
    bos_token_id: int | None = None
    pad_token: str | None = None
    pad_token_id: int | None = None
    unk_token: str | None = None
    unk_token_id: int | None = None
    stop_token_ids: list[int] = Field(description="generation stops at these: eos, and the model's end-of-turn "
                                                  "tokens (e.g. <|im_end|>)")
    chat_template: str = Field(description="the template chat renders through: --chat-template, else the model's, "
                                           "else the plain `Role: content` one")
    special_tokens_in_text: bool = Field(True, description="the literal text of a special (added) token in input "
                                                            "text is that token (the Hugging Face convention)")


class HealthResponse(ResponseModel):
    status: Literal["ok"] = "ok"

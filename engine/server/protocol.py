"""The OpenAI wire format: pydantic models for completions, chat completions, models and errors.

Requests are validated here, once, with errors that name the field (the API turns them into
OpenAI's error JSON). Responses and streaming chunks serialize to exactly what OpenAI sends,
plus two extensions: `top_k`/`ignore_eos` on requests and `usage.speculation` on responses.

Nothing a client sends is silently ignored. A field that changes what the output must be is
honoured or refused with a 400 naming it: the OpenAI fields not built yet (penalties, logit_bias,
tools, ...) are accepted only at their neutral values (`presence_penalty: 0`, `tools: []`), and an unknown
field is an unrecognized argument, as OpenAI itself answers. Fields that only describe the request
(`user`, `metadata`, `store`, `service_tier`) are accepted. docs/api.md has the table.

This file holds no behaviour: tokenization, generation and HTTP live in `serving.py` and `api.py`.
"""

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

FinishReason = Literal["stop", "length"]
MAX_CHOICES = 16
# Stop strings are matched against every streamed piece of every choice (`detokenizer.py`): OpenAI's
# count, and a length that makes each match microseconds (100,000 of them cost 110 ms per token).
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# Fields of OpenAI's API that are not built yet, with what they would ask for: each is accepted at
# its neutral values only, of the same type (`best_of: true` is not 1). Types are checked first, so a
# wrong type is named as such.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((None, 0.0), "a presence penalty"),
    "frequency_penalty": ((None, 0.0), "a frequency penalty"),
    "logit_bias": ((None, {}), "logit bias"),
    "best_of": ((None, 1), "best-of sampling"),
    "suffix": ((None, ""), "insertion before a suffix"),
    "tools": ((None, []), "function calling"),
    "tool_choice": ((None, "none"), "function calling"),
    "functions": ((None, []), "function calling"),
    "function_call": ((None, "none"), "function calling"),
    "modalities": ((None, ["text"]), "audio output"),
    "audio": ((None,), "audio output"),
    "prediction": ((None,), "predicted outputs"),
    "reasoning_effort": ((None,), "reasoning (the served model does not reason)"),
    "web_search_options": ((None,), "web search"),
}


def _not_built(name: str, value: Any) -> ValueError:
    neutral, what = _NEUTRAL[name]
    send = " or ".join(repr(n) for n in neutral if n is not None)
    return ValueError(f"{what} is not supported by this server yet: got {value!r}; "
                      f"{'send ' + send + ' or ' if send else ''}leave it out (docs/api.md)")


def _neutral_only(value: Any, info: ValidationInfo) -> Any:
    """A validator for the `_NEUTRAL` fields: the value itself, if it is neutral."""
    if not any(type(value) is type(n) and value == n for n in _NEUTRAL[info.field_name][0]):
        raise _not_built(info.field_name, value)
    return value


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. An unknown field is refused (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # extension (vLLM's): 0 = off
    seed: Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1)] | None = None  # int64, as OpenAI's
    stop: str | list[str] | None = None
    # Choices are sequences of their own: each has a KV-cache slot, so more than the slots wait their turn.
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM's): keep generating past end-of-sequence
    # Descriptive: accepted, and they change nothing in the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Not built yet: neutral values only (`_NEUTRAL`).
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    _check_neutral = field_validator("presence_penalty", "frequency_penalty", "logit_bias")(_neutral_only)

    @field_validator("stop")
    @classmethod
    def _stop_strings_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def token_limit(self) -> tuple[str, int] | None:
        """The client's completion-length limit and the field it came in, if it set one."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)


class CompletionRequest(_SamplingRequest):
    # A string, or token ids as the model will see them. Batches (lists of prompts) are not served.
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 only with echo: score the prompt
    echo: Annotated[bool, Field(validate_default=True)] = False  # the prompt's text (with logprobs, scored) first
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # each token's, and this many alternatives
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    _check_not_built = field_validator("suffix", "best_of")(_neutral_only)

    @field_validator("echo")
    @classmethod
    def _zero_tokens_only_to_score(cls, echo: bool, info: ValidationInfo) -> bool:
        if info.data.get("max_tokens") == 0 and not echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo (to score the prompt)")
        return echo


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    """Structured output: `json_object` (any JSON object) or `json_schema`, decoded under a grammar."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.json_schema or {}
        return None


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None  # each emitted token's log-probability, with top_logprobs alternatives
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # describes tool calls, of which there are none without tools
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    _check_not_built = field_validator("tools", "tool_choice", "functions",
                                       "function_call", "modalities", "audio", "prediction", "reasoning_effort",
                                       "web_search_options")(_neutral_only)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_limit(cls, limit: int | None, info: ValidationInfo) -> int | None:
        max_tokens = info.data.get("max_tokens")  # validated before: it is a field of the base class
        if limit is not None and max_tokens is not None and max_tokens != limit:
            raise ValueError(f"{limit} disagrees with max_tokens {max_tokens}; send only max_completion_tokens")
        return limit

    def token_limit(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_limit()

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text} for m in self.messages]


# --------------------------------------------------------------------------------------------- responses


class SpeculationUsage(BaseModel):
    """Extension: speculative-decoding counters for this request (docs/architecture.md, "Acceptance numbers")."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    mean_accepted_length: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculation: SpeculationUsage | None = None


class _Envelope(BaseModel):
    """What every completion response and chunk carries around its choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None  # the base-model fingerprint


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class CompletionResponse(_Envelope):
    """A completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _only_present(self) -> dict[str, Any]:
        # OpenAI's deltas carry only the keys that changed: {"role", "content": ""} first, then content.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------------------------- models, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specloop"
    fingerprint: str  # extension: docs/architecture.md, "Base-model fingerprint"
    max_model_len: int
    drafter_version: str | None = None  # extension: the drafter new requests draft with (None: none learned)
    weights: Literal["dense", "gguf", "nvfp4"] = "dense"  # extension: how the served layers hold their weights
    nvfp4_lm_head: bool | None = None  # extension, with weights "nvfp4": whether the LM head is NVFP4 too
    nvfp4_embedding: bool | None = None  # extension, with weights "nvfp4": whether the embedding is NVFP4 too
    quantized_from: str | None = None  # extension: the fingerprint of the model an NVFP4 one was quantized from


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody

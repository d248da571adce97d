"""The OpenAI wire format: pydantic models for completions, chat completions, models and errors.

Requests are validated here, once, with errors that name the field (the API turns them into
OpenAI's error JSON). Responses and streaming chunks serialize to exactly what OpenAI sends,
plus two extensions: `top_k`/`ignore_eos` on requests and `usage.speculation` on responses.

This file holds no behaviour: tokenization, generation and HTTP live in `serving.py` and `api.py`.
"""

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

FinishReason = Literal["stop", "length"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # extension (vLLM's): 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM's): keep generating past end-of-sequence

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings_nonempty(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
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
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None


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


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_token_limit(self) -> "ChatCompletionRequest":
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send only max_completion_tokens")
        return self

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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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
    weights: Literal["dense", "nvfp4"] = "dense"  # extension: how the served linear layers hold their weights
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

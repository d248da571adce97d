"""Trace schema v1: one record per finished request, as JSON on Kafka and as a row in Parquet.

`Trace` is the validated record (pydantic, strict: a token id sent as "5" is a wrong type, not a
5), `ARROW_SCHEMA` is its Parquet/Arrow shape, and `decode_trace` turns wire bytes into a `Trace`
or raises `TraceRejected` with a short reason that the sink puts on the dead-letter topic. The wire
format is plain JSON so that any Kafka client (confluent-kafka, a JVM service) can produce traces.

Version rule: a reader accepts only versions it knows (`schema_version == 1` here). Any change to
fields or their meaning is a new version with its own model, never an edit of this one; unknown
fields are rejected rather than dropped, so a v2 writer that forgets to bump the version is caught.

This module is not the producer, the sink or the consent check; it holds no I/O.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from datetime import UTC
from typing import Annotated, Literal

import pyarrow as pa
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1
KNOWN_VERSIONS = frozenset({SCHEMA_VERSION})

# Fingerprints and ids become hive directory names and file names: no separators, no spaces.
_SAFE_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_PSEUDONYM = r"^[0-9a-f]{64}$"

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
ShortText = Annotated[str, Field(min_length=1, max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class SamplingParams(_Strict):
    """The sampling parameters the request was served with (OpenAI names and meanings)."""

    temperature: float = Field(ge=0.0)
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: int = Field(ge=0, description="0 disables top-k")
    max_tokens: int = Field(ge=1)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class SpecStats(_Strict):
    """Speculation counters of one request; `accepted_tokens` excludes the bonus token."""

    drafts: int = Field(ge=0, description="target verify steps that checked a draft")
    draft_tokens: int = Field(ge=0)
    accepted_tokens: int = Field(ge=0)

    @model_validator(mode="after")
    def _accepted_within_drafted(self) -> SpecStats:
        if self.accepted_tokens > self.draft_tokens:
            raise ValueError("accepted_tokens exceeds draft_tokens")
        return self


class Trace(_Strict):
    """One finished request whose owner consented to its use for drafter training."""

    schema_version: Literal[1] = SCHEMA_VERSION
    trace_id: Annotated[str, Field(pattern=_SAFE_ID)]
    created_at: AwareDatetime
    finished_at: AwareDatetime
    tenant: ShortText
    subject: Annotated[str, Field(pattern=_PSEUDONYM)]
    consent_id: ShortText
    consent_policy_version: ShortText
    base_model: Annotated[str, Field(pattern=_SAFE_ID)]
    drafter_version: ShortText | None
    endpoint: ShortText
    sampling: SamplingParams
    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)]
    response_token_ids: list[TokenId]
    prompt_text: str | None = None
    response_text: str | None = None
    spec: SpecStats
    finish_reason: Literal["stop", "length", "abort", "error"]

    @model_validator(mode="after")
    def _finished_after_created(self) -> Trace:
        if self.finished_at < self.created_at:
            raise ValueError("finished_at is before created_at")
        return self

    def to_json(self) -> bytes:
        """The wire encoding (UTF-8 JSON)."""
        return self.model_dump_json().encode()



_TIMESTAMP = pa.timestamp("us", tz="UTC")
_TOKENS = pa.list_(pa.int32())

ARROW_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("created_at", _TIMESTAMP, nullable=False),
        pa.field("finished_at", _TIMESTAMP, nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        pa.field("subject", pa.string(), nullable=False),
        pa.field("consent_id", pa.string(), nullable=False),
        pa.field("consent_policy_version", pa.string(), nullable=False),
        pa.field("base_model", pa.string(), nullable=False),
        pa.field("drafter_version", pa.string()),
        pa.field("endpoint", pa.string(), nullable=False),
        pa.field(
            "sampling",
            pa.struct(
                [
                    pa.field("temperature", pa.float64(), nullable=False),
                    pa.field("top_p", pa.float64(), nullable=False),
                    pa.field("top_k", pa.int32(), nullable=False),
                    pa.field("max_tokens", pa.int32(), nullable=False),
                    pa.field("seed", pa.int64()),
                    pa.field("presence_penalty", pa.float64(), nullable=False),
                    pa.field("frequency_penalty", pa.float64(), nullable=False),
                ]
            ),
            nullable=False,
        ),
        pa.field("prompt_token_ids", _TOKENS, nullable=False),
        pa.field("response_token_ids", _TOKENS, nullable=False),
        pa.field("prompt_text", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field(
            "spec",
            pa.struct(
                [
                    pa.field("drafts", pa.int64(), nullable=False),
                    pa.field("draft_tokens", pa.int64(), nullable=False),
                    pa.field("accepted_tokens", pa.int64(), nullable=False),
                ]
            ),
            nullable=False,
        ),
        pa.field("finish_reason", pa.string(), nullable=False),
    ],
    metadata={"specloop.trace_schema_version": str(SCHEMA_VERSION)},
)

assert ARROW_SCHEMA.names == list(Trace.model_fields), "Arrow schema and Trace fields diverged"


def to_arrow(traces: Sequence[Trace]) -> pa.Table:
    """Traces as a table with `ARROW_SCHEMA`, built column by column.

    Column-wise building measured 6x faster than `Table.from_pylist(model_dump())` for traces of
    200 + 200 tokens (about 20 us vs 130 us per trace), which is what lets the sink reach 10k/s.
    """
    columns = []
    for field in ARROW_SCHEMA:
        if pa.types.is_struct(field.type):
            parts = [getattr(t, field.name) for t in traces]
            children = [pa.array([getattr(p, c.name) for p in parts], c.type) for c in field.type]
            columns.append(pa.StructArray.from_arrays(children, fields=list(field.type)))
        elif pa.types.is_list(field.type):
            columns.append(_token_lists([getattr(t, field.name) for t in traces]))
        else:
            columns.append(pa.array([getattr(t, field.name) for t in traces], field.type))
    return pa.Table.from_arrays(columns, schema=ARROW_SCHEMA)


def _token_lists(lists: list[list[int]]) -> pa.ListArray:
    offsets = [0, *itertools.accumulate(len(tokens) for tokens in lists)]
    values = pa.array(itertools.chain.from_iterable(lists), pa.int32())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)


class TraceRejected(ValueError):
    """A message that is not a valid v1 trace; `reason` is short and safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode_trace(value: bytes | None, max_bytes: int) -> Trace:
    """Validate wire bytes as a v1 trace, or raise `TraceRejected` naming why."""
    if value is None or not value:
        raise TraceRejected("empty: message has no value")
    if len(value) > max_bytes:
        raise TraceRejected(f"oversized: {len(value)} bytes > limit {max_bytes}")
    try:
        return Trace.model_validate_json(value)
    except ValidationError as error:
        raise TraceRejected(_diagnose(value, error)) from None


def _diagnose(value: bytes, error: ValidationError) -> str:
    """The reason a message failed validation; only runs on the (rare) failure path."""
    try:
        document = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        return f"malformed_json: {bad}"
    if not isinstance(document, dict):
        return f"malformed_json: top level is {type(document).__name__}, not an object"
    if "schema_version" not in document:
        return "missing_version: no schema_version field"
    version = document["schema_version"]
    if type(version) is not int or version not in KNOWN_VERSIONS:
        return f"unknown_version: schema_version={version!r}, known {sorted(KNOWN_VERSIONS)}"
    first = error.errors(include_url=False)[0]
    location = ".".join(str(part) for part in first["loc"]) or "<root>"
    return f"invalid: {location}: {first['msg']} ({error.error_count()} error(s))"


def trace_day(trace: Trace) -> str:
    """The `dt=` hive partition of a trace: the UTC date it was created."""
    return trace.created_at.astimezone(UTC).strftime("%Y-%m-%d")

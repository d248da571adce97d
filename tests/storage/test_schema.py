"""Trace schema v1: JSON round trip, Arrow conversion, and rejection reasons for bad input."""

import json
from datetime import timedelta

import pyarrow as pa
import pytest

from storage.schema import ARROW_SCHEMA, TraceRejected, decode_trace, to_arrow, trace_day
from tests.storage.traces import T0, make_trace

LIMIT = 64 * 1024


def _reason(value: bytes) -> str:
    with pytest.raises(TraceRejected) as caught:
        decode_trace(value, LIMIT)
    return caught.value.reason


def _mutated(**changes: object) -> bytes:
    document = json.loads(make_trace("t-1").to_json())
    document.update(changes)
    return json.dumps(document).encode()


def test_json_round_trip_is_lossless() -> None:
    trace = make_trace("t-1", prompt_len=50, response_len=3)
    assert decode_trace(trace.to_json(), LIMIT) == trace


def test_arrow_rows_match_the_model() -> None:
    traces = [make_trace(f"t-{i}", seed=i, prompt_len=i + 1) for i in range(5)]
    table = to_arrow(traces)
    assert table.schema == ARROW_SCHEMA
    rows = table.to_pylist()
    assert [r["trace_id"] for r in rows] == [t.trace_id for t in traces]
    assert rows[3]["prompt_token_ids"] == traces[3].prompt_token_ids
    assert rows[2]["sampling"] == traces[2].sampling.model_dump()
    assert rows[0]["created_at"] == traces[0].created_at
    assert pa.Table.from_pylist([t.model_dump() for t in traces], schema=ARROW_SCHEMA).equals(table)


def test_day_is_the_utc_date() -> None:
    late = make_trace(created_at=T0.replace(hour=23) + timedelta(hours=2))
    assert trace_day(late) == "2025-03-02"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "empty"),
        (b'{"schema_version": 1,', "malformed_json"),
        (b"\xff\xfe", "malformed_json"),
        (b"[1, 2]", "malformed_json"),
        (b'{"trace_id": "x"}', "missing_version"),
        (_mutated(schema_version=2), "unknown_version"),
        (_mutated(schema_version="1"), "unknown_version"),
        (_mutated(tenant=5), "invalid: tenant"),
        (_mutated(prompt_token_ids=["5"]), "invalid: prompt_token_ids.0"),
        (_mutated(prompt_token_ids=[2**31]), "invalid: prompt_token_ids.0"),
        (_mutated(subject="alice@example.com"), "invalid: subject"),
        (_mutated(base_model="../escape"), "invalid: base_model"),
        (_mutated(created_at="2025-03-01T12:00:00"), "invalid: created_at"),
        (_mutated(finished_at="2025-03-01T11:00:00Z"), "invalid: <root>"),
        (_mutated(surprise=1), "invalid: surprise"),
        (b'{"schema_version": 1, "pad": "' + b"x" * LIMIT + b'"}', "oversized"),
    ],
)
def test_bad_input_is_rejected_with_a_reason(value: bytes, reason: str) -> None:
    assert _reason(value).startswith(reason)

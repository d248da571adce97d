"""Trace schema v1: JSON round trip, Arrow conversion, and rejection reasons for bad input."""

import json
from datetime import timedelta

import pyarrow as pa
import pytest

from specloop.storage.schema import (
    ARROW_SCHEMA,
    Trace,
    TraceRejected,
    decode_row,
    decode_trace,
    rows_to_arrow,
    to_arrow,
    trace_day,
)
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


def _nested(part: str, **changes: object) -> bytes:
    document = json.loads(make_trace("t-1").to_json())
    document[part].update(changes)
    return json.dumps(document).encode()


def _without(name: str) -> bytes:
    document = json.loads(make_trace("t-1").to_json())
    del document[name]
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


# Inputs on both sides of every rule of Trace, for the fast decoder's agreement with it.
_EDGE_CASES = [
    make_trace("t-1").to_json(),
    make_trace("t-2", prompt_len=1, response_len=0).to_json(),
    make_trace("t-3").to_json().replace(b'"prompt_token_ids":[', b'"prompt_token_ids": [ 0 ,\n'),
    _without("schema_version"), _without("prompt_text"), _without("drafter_version"), _without("spec"),
    _mutated(schema_version=2), _mutated(schema_version=True), _mutated(schema_version=1.0),
    _mutated(trace_id="t-1\n"), _mutated(trace_id="-t"), _mutated(trace_id="t" * 128), _mutated(trace_id="t" * 129),
    _mutated(trace_id="t/1"), _mutated(trace_id=""), _mutated(subject="A" * 64), _mutated(subject="a" * 63),
    _mutated(subject="a" * 64 + "\n"), _mutated(tenant=""), _mutated(tenant="é" * 128), _mutated(tenant="é" * 129),
    _mutated(tenant=None), _mutated(drafter_version=None), _mutated(drafter_version=""),
    _mutated(base_model="fp:1.2_x-y"), _mutated(created_at="2025-03-01T12:00:00+02:00"),
    _mutated(created_at="2025-03-01"), _mutated(created_at=1740830400), _mutated(created_at="2025-03-01T12:00:00"),
    _mutated(finished_at="2025-03-01T12:00:00Z"), _mutated(finished_at="2025-03-01T11:59:59.999999Z"),
    _mutated(prompt_token_ids=[]), _mutated(prompt_token_ids=[0]), _mutated(prompt_token_ids=[2**31 - 1]),
    _mutated(prompt_token_ids=[2**31]), _mutated(prompt_token_ids=[-1]), _mutated(prompt_token_ids=[2**70]),
    _mutated(prompt_token_ids=[1.0]), _mutated(prompt_token_ids=[True]), _mutated(prompt_token_ids=["5"]),
    _mutated(prompt_token_ids=[None]), _mutated(prompt_token_ids=[[1]]), _mutated(prompt_token_ids={"a": 1}),
    _mutated(prompt_token_ids=5), _mutated(prompt_token_ids=None), _mutated(response_token_ids=[]),
    _mutated(response_token_ids=[1, -2]), _mutated(response_token_ids=[1e3]),
    _mutated(prompt_text=None), _mutated(prompt_text=5), _mutated(response_text=""),
    _mutated(finish_reason="stop"), _mutated(finish_reason="timeout"), _mutated(finish_reason=None),
    _mutated(endpoint="x" * 129), _mutated(surprise=1),
    make_trace("t-4").to_json().replace(b'"prompt_text":"hello"', b'"prompt_text":"he\\ud800llo"'),
    make_trace("t-5").to_json().replace(b'"prompt_text":"hello"', b'"prompt_text":"\\ud83d\\ude00"'),
    _nested("sampling", temperature=0), _nested("sampling", temperature=-0.1), _nested("sampling", temperature="0"),
    _nested("sampling", top_p=0.0), _nested("sampling", top_p=1.0), _nested("sampling", top_p=1.01),
    _nested("sampling", top_k=-1), _nested("sampling", top_k=1.0), _nested("sampling", top_k=2**40),
    _nested("sampling", max_tokens=0), _nested("sampling", seed=None), _nested("sampling", seed=True),
    _nested("sampling", seed=2**63), _nested("sampling", extra=1), _nested("sampling", presence_penalty=-2),
    _nested("spec", accepted_tokens=17), _nested("spec", accepted_tokens=16), _nested("spec", drafts=-1),
    _nested("spec", drafts=False),
    b"null", b"[]", b"{}", b'{"schema_version": 1}', b"\xff", b"{} {}",
]


@pytest.mark.parametrize("value", _EDGE_CASES)
def test_fast_decoder_agrees_with_the_model(value: bytes) -> None:
    try:
        trace = decode_trace(value, LIMIT)
    except TraceRejected as rejected:
        with pytest.raises(TraceRejected) as caught:
            decode_row(value, LIMIT)
        assert caught.value.reason == rejected.reason
    else:
        row = decode_row(value, LIMIT)
        try:
            expected = to_arrow([trace])
        except (pa.ArrowException, OverflowError):  # valid v1 that Parquet cannot hold: both must refuse
            with pytest.raises((pa.ArrowException, OverflowError)):
                rows_to_arrow([row])
        else:
            assert rows_to_arrow([row]).equals(expected)


def test_fast_decoder_takes_the_fast_road_for_ordinary_traces() -> None:
    rows = [decode_row(make_trace(f"t-{i}", seed=i, prompt_len=i + 1).to_json(), LIMIT) for i in range(5)]
    assert not any(isinstance(row.fields, Trace) for row in rows)
    assert rows_to_arrow(rows).equals(to_arrow([make_trace(f"t-{i}", seed=i, prompt_len=i + 1) for i in range(5)]))

"""The dataset builder: base-model and time filters, dedupe, consent exclusion at build time,
a deterministic split and a manifest whose digests follow the content."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specloop.storage.dataset import build_dataset
from specloop.storage.layout import hive_dir, sink_file_name, write_parquet_atomic
from specloop.storage.schema import Trace, to_arrow, trace_day
from tests.storage.traces import SUBJECT_A, SUBJECT_B, T0, make_trace

AS_OF = datetime(2025, 4, 1, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")


def _store(root: Path, traces: list[Trace], first_offset: int) -> None:
    """One file per hive directory, as the sink writes one batch."""
    by_directory: dict[Path, list[Trace]] = {}
    for trace in traces:
        by_directory.setdefault(hive_dir(root, trace.base_model, trace_day(trace)), []).append(trace)
    for directory, group in by_directory.items():
        write_parquet_atomic(directory / sink_file_name("t", 0, first_offset), to_arrow(group))


def _consent(rows: list[tuple]) -> pa.Table:
    columns = list(zip(*rows))
    return pa.table(
        {
            "consent_id": pa.array(columns[0], pa.string()),
            "tenant": pa.array(columns[1], pa.string()),
            "subject": pa.array(columns[2], pa.string()),
            "purpose": pa.array(["drafter_training"] * len(rows), pa.string()),
            "policy_version": pa.array(["2025-01"] * len(rows), pa.string()),
            "granted_at": pa.array(columns[3], TS),
            "expires_at": pa.array(columns[4], TS),
            "revoked_at": pa.array(columns[5], TS),
        }
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "traces"
    day = timedelta(days=1)
    keep = [make_trace(f"keep-{i:03d}", created_at=T0 + i * timedelta(minutes=1), seed=i) for i in range(200)]
    _store(root, keep, 0)
    _store(root, keep[:10], 1000)  # the same traces again: a duplicate delivery
    odd = [
        make_trace("other-model", base_model="fp-other"),
        make_trace("too-old", created_at=T0 - 10 * day),
        make_trace("revoked", subject=SUBJECT_B, consent_id="consent-b"),
        make_trace("expired", consent_id="consent-expired"),
        make_trace("no-consent", consent_id="consent-unknown"),
        make_trace("wrong-subject", consent_id="consent-b"),
    ]
    _store(root, odd, 2000)
    return root


CONSENT = _consent(
    [
        ("consent-a", "acme", SUBJECT_A, T0 - timedelta(days=30), None, None),
        ("consent-b", "acme", SUBJECT_B, T0 - timedelta(days=30), None, AS_OF - timedelta(days=1)),
        ("consent-expired", "acme", SUBJECT_A, T0 - timedelta(days=30), AS_OF - timedelta(hours=1), None),
    ]
)


def _build(store: Path, output: Path, **overrides: object) -> dict:
    arguments = {"base_model": "fp-test", "since": T0 - timedelta(days=1), "as_of": AS_OF, "eval_fraction": 0.2}
    build_dataset(store, output, CONSENT, **{**arguments, **overrides})
    return json.loads((output / "manifest.json").read_text())


def test_only_consented_unique_traces_of_the_base_model_and_window(store: Path, tmp_path: Path) -> None:
    manifest = _build(store, tmp_path / "out")
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    evaluation = pq.read_table(tmp_path / "out" / "eval.parquet")
    ids = train["trace_id"].to_pylist() + evaluation["trace_id"].to_pylist()
    assert sorted(ids) == [f"keep-{i:03d}" for i in range(200)]
    assert {"prompt_token_ids", "response_token_ids"} <= set(train.column_names)
    assert 20 <= evaluation.num_rows <= 60  # 20 % of 200 by hash
    assert manifest["rows_in_window"] == 214 and manifest["unique_traces"] == 204
    assert manifest["consented_traces"] == 200
    assert (manifest["train_rows"], manifest["eval_rows"]) == (train.num_rows, evaluation.num_rows)


def test_split_and_digest_are_deterministic(store: Path, tmp_path: Path) -> None:
    first = _build(store, tmp_path / "a")
    again = _build(store, tmp_path / "b")
    assert first["content_digest"] == again["content_digest"]
    assert pq.read_table(tmp_path / "a" / "eval.parquet").equals(pq.read_table(tmp_path / "b" / "eval.parquet"))
    limited = _build(store, tmp_path / "c", limit=50)
    assert limited["train_rows"] + limited["eval_rows"] == 50
    assert limited["content_digest"] != first["content_digest"]
    newest = {f"keep-{i:03d}" for i in range(150, 200)}
    chosen = pq.read_table(tmp_path / "c" / "train.parquet")["trace_id"].to_pylist()
    assert set(chosen) <= newest


def test_consent_revoked_after_capture_excludes_at_the_next_build(store: Path, tmp_path: Path) -> None:
    before = _build(store, tmp_path / "a")
    revoked = CONSENT.set_column(
        CONSENT.schema.get_field_index("revoked_at"), "revoked_at", pa.array([AS_OF - timedelta(seconds=1), *CONSENT["revoked_at"].to_pylist()[1:]], TS)
    )
    build_dataset(store, tmp_path / "b", revoked, base_model="fp-test", as_of=AS_OF)
    after = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert after["consented_traces"] == 0 and after["train_rows"] + after["eval_rows"] == 0
    assert after["consent_snapshot_digest"] != before["consent_snapshot_digest"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"base_model": "fp-missing"}, "base_model"),
        ({"limit": 0}, "limit"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"since": datetime(2025, 1, 1)}, "since"),
        ({"until": T0 - timedelta(days=2)}, "since"),
    ],
)
def test_bad_arguments_name_the_field(store: Path, tmp_path: Path, overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        _build(store, tmp_path / "out", **overrides)

"""The erased-subjects journal and its rule: a row of an erased (tenant, subject) created at or
before the erasure goes; one created after (consent granted again) stays; other tenants stay."""

from datetime import timedelta
from pathlib import Path

from specloop.storage.erased import read_erasures, record_erasure, without_erased
from specloop.storage.schema import to_arrow
from tests.storage.traces import SUBJECT_A, SUBJECT_B, T0, make_trace


def test_journal_round_trips_in_order(tmp_path: Path) -> None:
    assert read_erasures(tmp_path) == []
    first = record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    second = record_erasure(tmp_path, "acme", SUBJECT_B, T0 + timedelta(hours=1))
    assert read_erasures(tmp_path) == [first, second]
    assert first.erasure_id != second.erasure_id


def test_rows_created_up_to_the_erasure_are_dropped(tmp_path: Path) -> None:
    erasure = record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    table = to_arrow([
        make_trace("before", created_at=T0 - timedelta(seconds=1)),
        make_trace("at", created_at=T0),
        make_trace("after", created_at=T0 + timedelta(seconds=1)),  # a consent granted again later
        make_trace("other-subject", subject=SUBJECT_B),
        make_trace("other-tenant", tenant="globex"),
    ])
    kept, removed = without_erased(table, [erasure])
    assert removed == 2
    assert kept["trace_id"].to_pylist() == ["after", "other-subject", "other-tenant"]


def test_without_a_creation_time_every_row_of_the_subject_goes(tmp_path: Path) -> None:
    erasure = record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    table = to_arrow([make_trace("late", created_at=T0 + timedelta(days=1)), make_trace("b", subject=SUBJECT_B)])
    kept, removed = without_erased(table.drop_columns(["created_at"]), [erasure])
    assert (removed, kept["trace_id"].to_pylist()) == (1, ["b"])


def test_no_erasures_change_nothing(tmp_path: Path) -> None:
    table = to_arrow([make_trace("a")])
    assert without_erased(table, []) == (table, 0)

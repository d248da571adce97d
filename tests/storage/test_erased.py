"""The erased-subjects journal and its rule: a row of an erased (tenant, subject) created at or
before the erasure goes; one created after (consent granted again) stays; other tenants stay."""

from datetime import timedelta
from pathlib import Path

import pytest

from specloop.storage.erased import CLOCK_MARGIN, JournalCorrupt, read_erasures, record_erasure, without_erased
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
        make_trace("engine-clock-ahead", created_at=T0 + CLOCK_MARGIN),
        make_trace("after", created_at=T0 + CLOCK_MARGIN + timedelta(seconds=1)),  # a consent granted again later
        make_trace("other-subject", subject=SUBJECT_B),
        make_trace("other-tenant", tenant="globex"),
    ])
    kept, removed = without_erased(table, [erasure])
    assert removed == 3
    assert kept["trace_id"].to_pylist() == ["after", "other-subject", "other-tenant"]


def test_without_a_creation_time_every_row_of_the_subject_goes(tmp_path: Path) -> None:
    erasure = record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    table = to_arrow([make_trace("late", created_at=T0 + timedelta(days=1)), make_trace("b", subject=SUBJECT_B)])
    kept, removed = without_erased(table.drop_columns(["created_at"]), [erasure])
    assert (removed, kept["trace_id"].to_pylist()) == (1, ["b"])


def test_no_erasures_change_nothing(tmp_path: Path) -> None:
    table = to_arrow([make_trace("a")])
    assert without_erased(table, []) == (table, 0)


def test_a_cut_short_append_is_ignored_and_the_next_one_starts_a_line(tmp_path: Path) -> None:
    first = record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    with open(tmp_path / "_erasures.jsonl", "a") as journal:
        journal.write('{"erasure_id": "cut')  # a full disk mid-append
    assert read_erasures(tmp_path) == [first]
    second = record_erasure(tmp_path, "acme", SUBJECT_B, T0)
    assert read_erasures(tmp_path) == [first, second]


def test_a_corrupt_complete_line_is_an_error_naming_it(tmp_path: Path) -> None:
    record_erasure(tmp_path, "acme", SUBJECT_A, T0)
    with open(tmp_path / "_erasures.jsonl", "a") as journal:
        journal.write("not json\n")
    with pytest.raises(JournalCorrupt, match="_erasures.jsonl:2"):
        read_erasures(tmp_path)

"""Erasure rewrites every file holding a subject's traces without them, and nothing else."""

from pathlib import Path

import duckdb

from specloop.storage.erasure import erase_subject
from specloop.storage.layout import hive_dir, live_files, sink_file_name, write_parquet_atomic
from specloop.storage.schema import to_arrow
from tests.storage.traces import SUBJECT_A, SUBJECT_B, T0, make_trace


def _subjects(root: Path) -> list[tuple[str, str]]:
    files = [str(p) for p in live_files(root)]
    query = "SELECT tenant, subject, count(*) FROM read_parquet($f, hive_partitioning = false) GROUP BY ALL ORDER BY ALL"
    return duckdb.execute(query, {"f": files}).fetchall()


def test_erasure_removes_only_the_subjects_rows(tmp_path: Path) -> None:
    directory = hive_dir(tmp_path, "fp-test", "2025-03-01")
    mixed = [make_trace(subject=SUBJECT_A), make_trace(subject=SUBJECT_B), make_trace(subject=SUBJECT_A, tenant="other")]
    write_parquet_atomic(directory / sink_file_name("traces", 0, 0), to_arrow(mixed))
    write_parquet_atomic(directory / sink_file_name("traces", 1, 0), to_arrow([make_trace(subject=SUBJECT_A)]))
    untouched = directory / sink_file_name("traces", 2, 0)
    write_parquet_atomic(untouched, to_arrow([make_trace(subject=SUBJECT_B, created_at=T0)]))
    mtime = untouched.stat().st_mtime_ns

    result = erase_subject(tmp_path, "acme", SUBJECT_A)

    assert result.rows_removed == 2
    assert sorted(p.name for p in result.files_rewritten) == [sink_file_name("traces", 0, 0), sink_file_name("traces", 1, 0)]
    assert _subjects(tmp_path) == [("acme", SUBJECT_B, 2), ("other", SUBJECT_A, 1)]
    assert untouched.stat().st_mtime_ns == mtime
    assert len(live_files(tmp_path)) == 3  # an emptied file stays, keeping the sink's names
    assert erase_subject(tmp_path, "acme", SUBJECT_A).rows_removed == 0
    assert not list(directory.glob(".*.tmp"))

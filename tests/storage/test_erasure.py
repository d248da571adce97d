"""Erasure rewrites every file holding a subject's traces without them, and nothing else."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb

from specloop.storage.broker import SEGMENT_TIME, TOPIC_RETENTION
from specloop.storage.erased import CLOCK_MARGIN
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


def _run_dataset(work_dir: Path, run: str, traces: list, split: str = "train") -> Path:
    from specloop.storage.dataset import OUTPUT_COLUMNS

    path = work_dir / run / "dataset" / f"{split}.parquet"
    write_parquet_atomic(path, to_arrow(traces).select(list(OUTPUT_COLUMNS)))
    return path


def test_run_datasets_are_scrubbed_and_the_drafters_they_trained_are_named(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from specloop.storage.dataset_copies import Lineage, record_lineage, trained_on_erased

    root, work = tmp_path / "traces", tmp_path / "runs"
    gone = make_trace("gone-1", subject=SUBJECT_A)
    write_parquet_atomic(hive_dir(root, "fp-test", "2025-03-01") / sink_file_name("traces", 0, 0), to_arrow([gone]))
    trained = _run_dataset(work, "run-1", [gone, make_trace("kept-1", subject=SUBJECT_B)])
    _run_dataset(work, "run-1", [make_trace("gone-2", subject=SUBJECT_A)], "eval")
    record_lineage(work / "run-1", Lineage("run-1", "fp-test", "4", "dataset"))
    evaluated_only = _run_dataset(work, "run-2", [make_trace("gone-3", subject=SUBJECT_A)], "eval")
    untouched = _run_dataset(work, "run-3", [make_trace("kept-2", subject=SUBJECT_B)])
    # A dataset from before datasets kept the subject: scrubbed by the trace ids found in the store.
    old = work / "run-4" / "dataset" / "train.parquet"
    write_parquet_atomic(old, to_arrow([gone, make_trace("kept-3", subject=SUBJECT_B)]).select(
        ["trace_id", "endpoint", "prompt_token_ids", "response_token_ids"]))
    mtime = untouched.stat().st_mtime_ns

    result = erase_subject(root, "acme", SUBJECT_A, work)

    assert result.rows_removed == 1 and result.dataset_rows_removed == 4
    assert pq.read_table(trained)["trace_id"].to_pylist() == ["kept-1"]
    assert pq.read_table(evaluated_only).num_rows == 0
    assert pq.read_table(old)["trace_id"].to_pylist() == ["kept-3"]
    assert untouched.stat().st_mtime_ns == mtime
    assert [(x.run_id, x.base_model, x.version) for x in result.trained_on] == [
        ("run-1", "fp-test", "4"), ("run-4", None, None)]
    assert trained_on_erased(work / "run-1") == [result.erasure_id]
    expires = datetime.fromisoformat(result.kafka_copies_expire_by) - datetime.now(UTC)
    longest = CLOCK_MARGIN + SEGMENT_TIME + TOPIC_RETENTION
    assert longest - timedelta(minutes=1) < expires <= longest
    assert trained_on_erased(work / "run-2") == []  # judged on them, not trained on them
    assert erase_subject(root, "acme", SUBJECT_A, work).dataset_rows_removed == 0


def test_rows_compacted_away_between_listing_and_rewriting_are_followed(tmp_path: Path) -> None:
    from specloop.storage.compaction import compact
    from specloop.storage.erased import record_erasure
    from specloop.storage.erasure import _listed, _rewrite_files
    from specloop.storage.layout import exclusive

    directory = hive_dir(tmp_path, "fp-test", "2025-03-01")
    for offset in (0, 10, 20):  # the newest stays out of compaction; the first two merge
        write_parquet_atomic(directory / sink_file_name("traces", 0, offset),
                             to_arrow([make_trace(subject=SUBJECT_A), make_trace(subject=SUBJECT_B)]))
    with exclusive(tmp_path):
        erasure = record_erasure(tmp_path, "acme", SUBJECT_A)
        listed = _listed(tmp_path, erasure)
    assert len(listed) == 3 and compact(tmp_path).merged_files  # the sink's waiting files moved meanwhile

    rewritten, removed = _rewrite_files(tmp_path, erasure, listed)

    assert removed == 3 and any(p.name.startswith("compacted-") for p in rewritten)
    assert _subjects(tmp_path) == [("acme", SUBJECT_B, 3)]

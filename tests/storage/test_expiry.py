"""Retention of traces and run directories: rows older than their tenant's cutoff go, newer ones and
other tenants' stay; an expired run keeps only its lineage, which a later erasure still reads."""

from datetime import timedelta
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from specloop.storage.dataset import OUTPUT_COLUMNS
from specloop.storage.dataset_copies import TRAIN_SUBJECTS_FILE, Lineage, expire_run, record_lineage, scrub_subject
from specloop.storage.erased import record_erasure
from specloop.storage.expiry import expire_traces
from specloop.storage.layout import hive_dir, live_files, sink_file_name, write_parquet_atomic
from specloop.storage.schema import to_arrow
from tests.storage.traces import SUBJECT_A, SUBJECT_B, T0, make_trace


def _ids(root: Path) -> list[str]:
    files = [str(p) for p in live_files(root)]
    query = "SELECT trace_id FROM read_parquet($f) ORDER BY trace_id"
    return [r[0] for r in duckdb.execute(query, {"f": files}).fetchall()]


def test_rows_older_than_their_tenants_cutoff_expire(tmp_path: Path) -> None:
    day = timedelta(days=1)
    old_file = hive_dir(tmp_path, "fp-test", "2025-02-01") / sink_file_name("traces", 0, 0)
    write_parquet_atomic(old_file, to_arrow([make_trace("acme-old", created_at=T0 - 20 * day),
                                             make_trace("globex-old", created_at=T0 - 20 * day, tenant="globex")]))
    mixed = hive_dir(tmp_path, "fp-test", "2025-02-25") / sink_file_name("traces", 0, 10)
    write_parquet_atomic(mixed, to_arrow([make_trace("acme-mid", created_at=T0 - 5 * day),
                                          make_trace("initech-mid", created_at=T0 - 5 * day, tenant="initech")]))
    fresh = hive_dir(tmp_path, "fp-test", "2025-03-01") / sink_file_name("traces", 0, 20)
    write_parquet_atomic(fresh, to_arrow([make_trace("acme-new", created_at=T0)]))
    mtime = fresh.stat().st_mtime_ns

    # acme keeps 30 days, globex 7; everyone else the default of 3.
    result = expire_traces(tmp_path, {"acme": T0 - 30 * day, "globex": T0 - 7 * day}, T0 - 3 * day)

    assert result.rows_removed == 2
    assert _ids(tmp_path) == ["acme-mid", "acme-new", "acme-old"]
    assert fresh.stat().st_mtime_ns == mtime
    assert expire_traces(tmp_path, {"acme": T0 - 30 * day}, None).rows_removed == 0  # None: kept


def test_an_expired_run_keeps_its_lineage_and_a_later_erasure_still_names_its_drafter(tmp_path: Path) -> None:
    run = tmp_path / "20250301-120000-abcdef"
    rows = to_arrow([make_trace("a", subject=SUBJECT_A), make_trace("b", subject=SUBJECT_B)])
    write_parquet_atomic(run / "dataset" / "train.parquet", rows.select(list(OUTPUT_COLUMNS)))
    write_parquet_atomic(run / "dataset" / "eval.parquet", rows.select(list(OUTPUT_COLUMNS)))
    (run / "challenger").mkdir()
    (run / "challenger" / "model.safetensors").write_bytes(b"x" * 1000)
    record_lineage(run, Lineage(run.name, "fp-test", "7", "dataset"))

    assert expire_run(run) > 1000
    assert sorted(p.name for p in run.iterdir()) == ["registered.json", TRAIN_SUBJECTS_FILE]
    assert sorted(pq.read_table(run / TRAIN_SUBJECTS_FILE)["subject"].to_pylist()) == [SUBJECT_A, SUBJECT_B]
    assert expire_run(run) == 0  # nothing left to free

    scrubbed = scrub_subject(tmp_path, record_erasure(tmp_path, "acme", SUBJECT_A))
    assert [(x.run_id, x.version) for x in scrubbed.trained_on] == [(run.name, "7")]
    assert pq.read_table(run / TRAIN_SUBJECTS_FILE)["subject"].to_pylist() == [SUBJECT_B]


def test_a_torn_run_erasure_record_is_ignored(tmp_path: Path) -> None:
    from specloop.storage.dataset_copies import trained_on_erased

    run = tmp_path / "run-1"
    run.mkdir()
    (run / "erasures.jsonl").write_text('{"erasure_id": "e1", "rows_removed": 1, "trained": true}\n{"erasure_id": "e')
    assert trained_on_erased(run) == ["e1"]

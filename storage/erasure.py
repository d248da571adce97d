"""Erasure: every copy of a subject's traces under the traces root and the daemon's work directory.

Under the root's maintenance lock, at once: the erasure is appended to the root's journal
(`specloop.storage.erased`), so the sink drops the subject's rows that are still in flight or that
Kafka replays later; any interrupted compaction is finished; the files holding the subject are
listed. Then, taking the lock again for each (so the sink waits for one file, not the whole
erasure), every live or compacted Parquet file holding the subject is replaced atomically (temp,
fsync, rename, dir fsync) under the same name, so a reader sees the file before or after, never
half of it (a file left with no rows stays as an empty file to keep the sink's naming intact);
then, given the daemon's work directory, every dataset a run built is scrubbed of the subject
(`specloop.storage.dataset_copies`), and the runs whose training split held them are reported with
the drafter versions they registered.

Not erased here: Kafka's own copies (they expire by the topics' retention, `specloop.storage.broker`;
the report says by when)
and drafter weights (the daemon's `on_erasure` policy decides). This module is not the consent
registry and writes no audit log: consent's revocation is handed `erase_subject` by the code that
joins the two (`consent/erasure.py` says where) and records the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from specloop.storage.broker import SEGMENT_TIME, TOPIC_RETENTION
from specloop.storage.compaction import finish_pending, rewrite_each
from specloop.storage.dataset_copies import Lineage, scrub_subject
from specloop.storage.erased import CLOCK_MARGIN, Erasure, record_erasure, without_erased
from specloop.storage.layout import exclusive, live_files, write_parquet_atomic
from specloop.storage.schema import ARROW_SCHEMA

_MAX_PASSES = 5  # listings of the subject's files; each pass after the first follows a compaction


@dataclass(frozen=True, slots=True)
class ErasureResult:
    erasure_id: str  # the journal entry the sink and the daemon apply to later copies
    files_rewritten: tuple[Path, ...]
    rows_removed: int
    dataset_files_rewritten: tuple[Path, ...] = ()
    dataset_rows_removed: int = 0
    trained_on: tuple[Lineage, ...] = ()  # runs (and their drafter versions) whose training set held them
    # When the subject's last trace in Kafka expires, on topics with specloop's retention (`TOPIC_RETENTION`).
    kafka_copies_expire_by: str = ""
    # Whether the daemon's work directory was on this machine; if not, the daemon scrubs its datasets
    # and reports the drafters trained on the subject itself (an `erasure_lineage` audit entry).
    work_dir_reached: bool = False


def erase_subject(root: Path, tenant: str, subject: str, work_dir: Path | None = None) -> ErasureResult:
    """Remove every trace of (`tenant`, `subject`) from the Parquet files under `root` and, when
    given, from the datasets under the daemon's `work_dir`."""
    if not tenant or not subject:
        raise ValueError("tenant and subject must be non-empty")
    if not root.is_dir():  # a wrong root would otherwise be created empty and audited "ok, 0 rows"
        raise FileNotFoundError(f"traces root {root} is not a directory: nothing was erased")
    with exclusive(root):  # journalled and listed at once: a sink write after this reads the entry
        erasure = record_erasure(root, tenant, subject)
        affected = _listed(root, erasure)
        trace_ids = _trace_ids(affected, erasure)
    rewritten, removed = _rewrite_files(root, erasure, affected)
    expires = kafka_copies_expire_by(erasure).isoformat()
    if work_dir is None or not work_dir.is_dir():
        return ErasureResult(erasure.erasure_id, rewritten, removed, kafka_copies_expire_by=expires)
    scrubbed = scrub_subject(work_dir, erasure, trace_ids)
    return ErasureResult(erasure.erasure_id, rewritten, removed, scrubbed.files_rewritten,
                         scrubbed.rows_removed, scrubbed.trained_on, expires, work_dir_reached=True)


def apply_erasure(root: Path, erasure: Erasure) -> int:
    """Rewrite the trace files under `root` by a journalled erasure again (rows removed): an eraser
    that crashed between journalling and rewriting leaves the rows there, and the daemon calls this
    for every new journal entry."""
    with exclusive(root):
        affected = _listed(root, erasure)
    return _rewrite_files(root, erasure, affected)[1]


def kafka_copies_expire_by(erasure: Erasure) -> datetime:
    """When the last record of the subject is gone from Kafka: Kafka deletes whole segments, so a
    record lives up to the retention after its segment closes (`SEGMENT_TIME` at most); records
    created up to `CLOCK_MARGIN` after the erasure count as erased too."""
    return erasure.erased_at + CLOCK_MARGIN + SEGMENT_TIME + TOPIC_RETENTION


def _listed(root: Path, erasure: Erasure) -> list[Path]:
    """The files holding the subject's rows; the caller holds the lock."""
    finish_pending(root)
    return _affected_files(root, erasure)


def _rewrite_files(root: Path, erasure: Erasure, affected: list[Path]) -> tuple[tuple[Path, ...], int]:
    """Rewrite `affected` one file at a time (`rewrite_each`). A file compacted away in between moved
    its rows into a merged file, so the files are listed again until none holds the subject; new
    sink files never do, since the erasure is in the journal they are filtered by."""
    rewritten: list[Path] = []
    removed = 0
    for _ in range(_MAX_PASSES):
        done, rows, moved = rewrite_each(root, affected, lambda path: _rewrite_without(path, erasure))
        rewritten += done
        removed += rows
        if not moved:
            return tuple(dict.fromkeys(rewritten)), removed
        with exclusive(root):
            affected = _listed(root, erasure)
    raise RuntimeError(f"erasure {erasure.erasure_id}: files kept moving under compaction; run it again")


def _trace_ids(files: list[Path], erasure: Erasure) -> frozenset[str]:
    """The subject's trace ids, for dataset copies older than the subject column."""
    if not files:
        return frozenset()
    rows = duckdb.execute(
        "SELECT DISTINCT trace_id FROM read_parquet($files, hive_partitioning = false) "
        "WHERE tenant = $tenant AND subject = $subject",
        {"files": [str(p) for p in files], "tenant": erasure.tenant, "subject": erasure.subject},
    ).fetchall()
    return frozenset(t for (t,) in rows)


def _affected_files(root: Path, erasure: Erasure) -> list[Path]:
    files = [str(p) for p in live_files(root)]
    if not files:
        return []
    rows = duckdb.execute(
        "SELECT DISTINCT filename FROM read_parquet($files, filename = true, hive_partitioning = false) "
        "WHERE tenant = $tenant AND subject = $subject AND created_at <= $until ORDER BY filename",
        {"files": files, "tenant": erasure.tenant, "subject": erasure.subject,
         "until": erasure.erased_at + CLOCK_MARGIN},
    ).fetchall()
    return [Path(name) for (name,) in rows]


def _rewrite_without(path: Path, erasure: Erasure) -> int:
    table = pq.read_table(path, schema=ARROW_SCHEMA, partitioning=None)
    kept, removed = without_erased(table, [erasure])
    write_parquet_atomic(path, kept)
    return removed

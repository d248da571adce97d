"""Erasure: every copy of a subject's traces under the traces root and the daemon's work directory.

Under the root's maintenance lock, in order: the erasure is appended to the root's journal
(`specloop.storage.erased`), so the sink drops the subject's rows that are still in flight or that
Kafka replays later; any interrupted compaction is finished; every live or compacted Parquet file
holding the subject is replaced atomically (temp, fsync, rename, dir fsync) under the same name, so
a reader sees the file before or after, never half of it (a file left with no rows stays as an
empty file to keep the sink's naming intact); then, given the daemon's work directory, every
dataset a run built is scrubbed of the subject (`specloop.storage.dataset_copies`), and the runs
whose training split held them are reported with the drafter versions they registered.

Not erased here: Kafka's own copies (they expire by the topics' retention, `specloop.storage.broker`;
the report says by when)
and drafter weights (the daemon's `on_erasure` policy decides). This module is not the consent
registry and writes no audit log: consent's revocation is handed `erase_subject` by the code that
joins the two (`consent/erasure.py` says where) and records the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specloop.storage.broker import TOPIC_RETENTION
from specloop.storage.compaction import finish_pending
from specloop.storage.dataset_copies import Lineage, scrub_subject
from specloop.storage.erased import record_erasure
from specloop.storage.layout import exclusive, live_files, write_parquet_atomic
from specloop.storage.schema import ARROW_SCHEMA


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


def erase_subject(root: Path, tenant: str, subject: str, work_dir: Path | None = None) -> ErasureResult:
    """Remove every trace of (`tenant`, `subject`) from the Parquet files under `root` and, when
    given, from the datasets under the daemon's `work_dir`."""
    if not tenant or not subject:
        raise ValueError("tenant and subject must be non-empty")
    if not root.is_dir():  # a wrong root would otherwise be created empty and audited "ok, 0 rows"
        raise FileNotFoundError(f"traces root {root} is not a directory: nothing was erased")
    rewritten: list[Path] = []
    removed = 0
    with exclusive(root):
        erasure = record_erasure(root, tenant, subject)
        finish_pending(root)
        affected = _affected_files(root, tenant, subject)
        trace_ids = _trace_ids(affected, tenant, subject)
        for path in affected:
            removed += _rewrite_without(path, tenant, subject)
            rewritten.append(path)
    expires = (erasure.erased_at + TOPIC_RETENTION).isoformat()
    if work_dir is None:
        return ErasureResult(erasure.erasure_id, tuple(rewritten), removed, kafka_copies_expire_by=expires)
    scrubbed = scrub_subject(work_dir, erasure, trace_ids)
    return ErasureResult(erasure.erasure_id, tuple(rewritten), removed, scrubbed.files_rewritten,
                         scrubbed.rows_removed, scrubbed.trained_on, expires)


def _trace_ids(files: list[Path], tenant: str, subject: str) -> frozenset[str]:
    """The subject's trace ids, for dataset copies older than the subject column."""
    if not files:
        return frozenset()
    rows = duckdb.execute(
        "SELECT DISTINCT trace_id FROM read_parquet($files, hive_partitioning = false) "
        "WHERE tenant = $tenant AND subject = $subject",
        {"files": [str(p) for p in files], "tenant": tenant, "subject": subject},
    ).fetchall()
    return frozenset(t for (t,) in rows)


def _affected_files(root: Path, tenant: str, subject: str) -> list[Path]:
    files = [str(p) for p in live_files(root)]
    if not files:
        return []
    rows = duckdb.execute(
        "SELECT DISTINCT filename FROM read_parquet($files, filename = true, hive_partitioning = false) "
        "WHERE tenant = $tenant AND subject = $subject ORDER BY filename",
        {"files": files, "tenant": tenant, "subject": subject},
    ).fetchall()
    return [Path(name) for (name,) in rows]


def _rewrite_without(path: Path, tenant: str, subject: str) -> int:
    table = pq.read_table(path, schema=ARROW_SCHEMA, partitioning=None)
    matches = pc.and_(pc.equal(table["tenant"], tenant), pc.equal(table["subject"], subject))
    kept = table.filter(pc.invert(matches))
    write_parquet_atomic(path, kept)
    return table.num_rows - kept.num_rows

"""Retention: rewrite trace files without the rows older than their tenant's retention.

A tenant's cutoff is a time: rows of that tenant created before it expire. Tenants without their
own cutoff get the default one (None: kept). Like erasure, expiry holds the root's maintenance
lock, finishes any interrupted compaction first, and replaces each affected file atomically under
its name (an emptied file stays, keeping the sink's names). Rows are selected by `created_at`, so a
file of old and new rows is rewritten with the new ones. Kafka's copies expire by the topics' own
retention (`specloop.storage.broker.TOPIC_RETENTION`) and run datasets with their run directories
(`specloop.storage.dataset_copies.expire_run`).

This module is not the scheduler (the daemon runs it, `daemon/retrain/retention.py`) and does not
read the tenants file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specloop.storage.compaction import finish_pending, rewrite_each
from specloop.storage.layout import exclusive, live_files, write_parquet_atomic
from specloop.storage.schema import ARROW_SCHEMA


@dataclass(frozen=True, slots=True)
class ExpiryResult:
    files_rewritten: tuple[Path, ...]
    rows_removed: int


def expire_traces(root: Path, cutoffs: Mapping[str, datetime], default: datetime | None) -> ExpiryResult:
    """Remove every row created before its tenant's cutoff (`cutoffs`, else `default`) under `root`."""
    if not root.is_dir():
        raise FileNotFoundError(f"traces root {root} is not a directory")
    if default is None and not cutoffs:
        return ExpiryResult((), 0)
    with exclusive(root):
        finish_pending(root)
        affected = _affected_files(live_files(root), cutoffs, default)
    # A file compacted away meanwhile has its rows in the merged file: the next pass expires them.
    rewritten, removed, _ = rewrite_each(root, affected, lambda path: _rewrite_without_expired(path, cutoffs, default))
    return ExpiryResult(tuple(rewritten), removed)


def _cutoff_table(cutoffs: Mapping[str, datetime]) -> pa.Table:
    return pa.table({"tenant": pa.array(list(cutoffs), pa.string()),
                     "cutoff": pa.array(list(cutoffs.values()), pa.timestamp("us", tz="UTC"))})


def _affected_files(files: list[Path], cutoffs: Mapping[str, datetime], default: datetime | None) -> list[Path]:
    if not files:
        return []
    con = duckdb.connect()
    con.register("cutoffs", _cutoff_table(cutoffs))
    rows = con.execute(
        "SELECT DISTINCT t.filename FROM read_parquet($files, filename = true, hive_partitioning = false) t "
        "LEFT JOIN cutoffs c ON c.tenant = t.tenant "
        "WHERE t.created_at < coalesce(c.cutoff, $default) ORDER BY t.filename",
        {"files": [str(p) for p in files], "default": default},
    ).fetchall()
    return [Path(name) for (name,) in rows]


def _rewrite_without_expired(path: Path, cutoffs: Mapping[str, datetime], default: datetime | None) -> int:
    table = pq.read_table(path, schema=ARROW_SCHEMA, partitioning=None)
    tenants = table["tenant"].to_pylist()
    limits = pa.array([cutoffs.get(t, default) for t in tenants], pa.timestamp("us", tz="UTC"))
    expired = pc.fill_null(pc.less(table["created_at"], limits), False)  # no cutoff: kept
    kept = table.filter(pc.invert(expired))
    write_parquet_atomic(path, kept)
    return table.num_rows - kept.num_rows

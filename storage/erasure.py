"""Erasure: rewrite every Parquet file holding a subject's traces without them.

Each affected file is replaced atomically (temp, fsync, rename, dir fsync) under the same name, so
a reader sees the file before or after, never half of it; a file left with no rows stays as an
empty file to keep the sink's naming intact. Erasure holds the root's maintenance lock and first
finishes any interrupted compaction, so it never races a merge.

Limit: a sink batch not yet committed when erasure runs is replayed from Kafka and can bring the
subject's rows back; the dataset builder still excludes them (it joins against consent), and
running erasure again after the sink has caught up removes them. This module is not the consent
registry and writes no audit log: consent's revocation is handed `erase_subject` by the code that
joins the two (`consent/erasure.py` says where) and records the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specloop.storage.compaction import finish_pending
from specloop.storage.layout import exclusive, live_files, write_parquet_atomic
from specloop.storage.schema import ARROW_SCHEMA


@dataclass(frozen=True, slots=True)
class ErasureResult:
    files_rewritten: tuple[Path, ...]
    rows_removed: int


def erase_subject(root: Path, tenant: str, subject: str) -> ErasureResult:
    """Remove every trace of (`tenant`, `subject`) from the Parquet files under `root`."""
    if not tenant or not subject:
        raise ValueError("tenant and subject must be non-empty")
    if not root.is_dir():  # a wrong root would otherwise be created empty and audited "ok, 0 rows"
        raise FileNotFoundError(f"traces root {root} is not a directory: nothing was erased")
    rewritten: list[Path] = []
    removed = 0
    with exclusive(root):
        finish_pending(root)
        for path in _affected_files(root, tenant, subject):
            removed += _rewrite_without(path, tenant, subject)
            rewritten.append(path)
    return ErasureResult(tuple(rewritten), removed)


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

"""Compaction: merge the small files of each hive directory into one, without changing any row.

A merge of sources S in directory D runs in five durable steps:

1. write `_compaction-<digest(S)>.json` naming S and the merged file `compacted-<digest(S)>.parquet`;
2. write the merged file (the rows of S in name order) atomically;
3. remove S;
4. remove the manifest.

`specloop.storage.layout.live_files` hides S as soon as the merged file exists, so a reader that lists
through it sees every row exactly once after a crash at any step; the next `compact` (or an
erasure) finishes the merge (`finish_pending`). Files the sink may still replay are never merged:
for each Kafka partition the sink files with the newest first offset stay out, because only the
newest batch of a partition can be uncommitted (the sink commits a batch before it writes the
next).

`rewrite_each` is the other maintenance step erasure and expiry share: files rewritten one at a time
under the lock, noticing the ones a merge took away.

This module is not the sink and does not dedupe: a merged file holds exactly its sources' rows.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specloop.storage.layout import (
    exclusive,
    parse_sink_file,
    pending_merges,
    remove_durably,
    write_json_atomic,
    write_parquet_atomic,
)
from specloop.storage.schema import ARROW_SCHEMA

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompactionResult:
    merged_files: tuple[Path, ...]
    sources_removed: int
    rows: int


def compact(root: Path, min_files: int = 2) -> CompactionResult:
    """Merge every hive directory under `root` holding at least `min_files` mergeable files."""
    if min_files < 2:
        raise ValueError(f"min_files must be >= 2, got {min_files}")
    merged: list[Path] = []
    removed = rows = 0
    with exclusive(root):
        finish_pending(root)
        replayable = _replayable(root)
        for directory in sorted(root.glob("base_model=*/dt=*")):
            sources = [p for p in sorted(directory.glob("*.parquet")) if p not in replayable]
            if len(sources) >= min_files:
                target, count = _merge(directory, sources)
                merged.append(target)
                removed += len(sources)
                rows += count
    return CompactionResult(tuple(merged), removed, rows)


def finish_pending(root: Path) -> None:
    """Complete or roll back merges a crash interrupted. Call with the root lock held."""
    for directory in root.glob("base_model=*/dt=*"):
        for manifest, merged, sources in pending_merges(directory):
            if merged.exists():
                remove_durably(sources)
            remove_durably([manifest])


def _replayable(root: Path) -> set[Path]:
    """Sink files of the newest batch of each Kafka partition: possibly not committed yet."""
    newest: dict[tuple[str, int], int] = {}
    files = [f for f in map(parse_sink_file, root.glob("base_model=*/dt=*/*.parquet")) if f is not None]
    for f in files:
        key = (f.topic, f.partition)
        newest[key] = max(newest.get(key, -1), f.first_offset)
    return {f.path for f in files if f.first_offset == newest[(f.topic, f.partition)]}


def _merge(directory: Path, sources: list[Path]) -> tuple[Path, int]:
    names = [p.name for p in sources]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    target = directory / f"compacted-{digest}.parquet"
    manifest = directory / f"_compaction-{digest}.json"
    write_json_atomic(manifest, {"merged": target.name, "sources": names})
    table = pa.concat_tables([pq.read_table(p, schema=ARROW_SCHEMA, partitioning=None) for p in sources])
    write_parquet_atomic(target, table)
    remove_durably(sources)
    remove_durably([manifest])
    log.info("merged %d files (%d rows) into %s", len(sources), table.num_rows, target)
    return target, table.num_rows


def rewrite_each(root: Path, paths: list[Path], rewrite: Callable[[Path], int]) -> tuple[list[Path], int, bool]:
    """Call `rewrite` (rows removed) on each of `paths` still there, taking the root's lock for each
    file, so that the sink waits for one file at a time, never for a whole pass (about 40 ms a
    file, benchmarks/erasure_cost.py). Returns the files rewritten, the rows removed, and whether any
    was gone: compacted away in between, its rows now in a merged file."""
    rewritten: list[Path] = []
    removed, gone = 0, False
    for path in paths:
        with exclusive(root):
            finish_pending(root)
            if path.exists():
                removed += rewrite(path)
                rewritten.append(path)
            else:
                gone = True
    return rewritten, removed, gone

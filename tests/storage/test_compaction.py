"""Compaction merges small files without changing rows, protects replayable files, and a crash at
any step leaves readers (through `live_files`) with every row exactly once."""

from collections import Counter
from pathlib import Path

import duckdb
import pytest

from specloop.storage.compaction import compact, finish_pending
from specloop.storage.layout import hive_dir, live_files, sink_file_name, write_json_atomic, write_parquet_atomic
from specloop.storage.schema import to_arrow
from tests.storage.traces import make_trace


def _write_batches(root: Path, batches: int, per_batch: int = 5) -> Path:
    directory = hive_dir(root, "fp-test", "2025-03-01")
    for b in range(batches):
        traces = [make_trace(f"c-{b}-{i}", seed=b * 100 + i) for i in range(per_batch)]
        write_parquet_atomic(directory / sink_file_name("traces", b % 2, b * per_batch), to_arrow(traces))
    return directory


def _content(root: Path) -> Counter:
    files = [str(p) for p in live_files(root)]
    rows = duckdb.execute(
        "SELECT trace_id, prompt_token_ids, spec FROM read_parquet($f, hive_partitioning = false)", {"f": files}
    ).fetchall()
    return Counter((r[0], tuple(r[1]), tuple(r[2].items())) for r in rows)


def test_compaction_keeps_every_row_and_leaves_replayable_files(tmp_path: Path) -> None:
    directory = _write_batches(tmp_path, batches=6)
    before = _content(tmp_path)
    result = compact(tmp_path)
    after = _content(tmp_path)
    assert after == before and sum(after.values()) == 30
    names = sorted(p.name for p in directory.glob("*.parquet"))
    # Newest batch of partition 0 (offset 20) and of partition 1 (offset 25) may be uncommitted.
    assert names[1:] == [sink_file_name("traces", 0, 20), sink_file_name("traces", 1, 25)]
    assert names[0].startswith("compacted-") and result.sources_removed == 4 and result.rows == 20
    assert compact(tmp_path).merged_files == ()
    assert not list(directory.glob("_compaction-*"))


@pytest.mark.parametrize("crashed_after", ["manifest", "merged", "some_sources_removed"])
def test_a_crashed_merge_is_invisible_to_readers_and_finished_later(tmp_path: Path, crashed_after: str) -> None:
    directory = _write_batches(tmp_path, batches=4)
    before = _content(tmp_path)
    sources = sorted(directory.glob("*.parquet"))[:2]
    merged = directory / "compacted-crash.parquet"
    write_json_atomic(directory / "_compaction-crash.json", {"merged": merged.name, "sources": [p.name for p in sources]})
    if crashed_after != "manifest":
        import pyarrow as pa
        import pyarrow.parquet as pq

        write_parquet_atomic(merged, pa.concat_tables([pq.read_table(p, partitioning=None) for p in sources]))
    if crashed_after == "some_sources_removed":
        sources[0].unlink()
    assert _content(tmp_path) == before
    finish_pending(tmp_path)
    assert _content(tmp_path) == before
    assert not list(directory.glob("_compaction-*"))
    assert set(live_files(tmp_path)) == set(directory.glob("*.parquet"))

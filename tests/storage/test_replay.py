"""A flush that wrote its files but crashed before committing is replayed, never doubled.

The second sink uses different batch boundaries than the first, so the replay writes different
file names: the stale files must be removed by reconciliation, not merely overwritten.
"""

import threading
from datetime import timedelta
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from specloop.storage.layout import live_files
from specloop.storage.sink import SinkConfig, TraceSink
from tests.storage.traces import T0, make_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class _Crash(Exception):
    pass


def _crash_on_commit(*_: object, **__: object) -> None:
    raise _Crash


def _rows(root: Path) -> list[str]:
    files = [str(p) for p in live_files(root)]
    return [r[0] for r in duckdb.execute("SELECT trace_id FROM read_parquet($f) ORDER BY 1", {"f": files}).fetchall()]


def _largest_file(root: Path) -> int:
    return max((pq.ParquetFile(p).metadata.num_rows for p in live_files(root)), default=0)


def test_uncommitted_files_are_replaced_by_the_replay(sink_config: SinkConfig) -> None:
    traces = [make_trace(f"r-{i:03d}", created_at=T0 + timedelta(hours=i % 20)) for i in range(120)]
    producer = KafkaProducer(bootstrap_servers=sink_config.bootstrap_servers, acks="all")
    for trace in traces:
        producer.send(sink_config.topic, key=trace.trace_id.encode(), value=trace.to_json())
    producer.flush()
    producer.close()

    first = TraceSink(sink_config, registry=CollectorRegistry())
    first._commit = _crash_on_commit
    with pytest.raises(_Crash):
        while True:
            first.poll_once()
    first.close()
    assert _largest_file(sink_config.root) > 7 and len(_rows(sink_config.root)) == len(traces)

    second_config = sink_config.model_copy(update={"flush_records": 7})
    registry = CollectorRegistry()
    second = TraceSink(second_config, registry=registry)
    stop = threading.Event()
    thread = threading.Thread(target=second.run, args=(stop,))
    thread.start()
    try:
        for _ in range(300):
            if registry.get_sample_value("specloop_sink_traces_written_total") >= len(traces):
                break
            stop.wait(0.1)
    finally:
        stop.set()
        thread.join(30)
    assert _rows(sink_config.root) == sorted(t.trace_id for t in traces)
    assert _largest_file(sink_config.root) <= 7, "a stale file of the crashed flush survived"

"""Fixtures for the storage tests: a unique topic per test and a sink running in a thread.

Each test gets its own topic and consumer group on the shared session broker, so tests do not see
each other's records.
"""

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from specloop.storage.broker import EmbeddedBroker, ensure_topics
from specloop.storage.sink import SinkConfig, TraceSink


@pytest.fixture
def topic(broker: EmbeddedBroker) -> str:
    name = f"traces-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap_servers, {name: 3, f"{name}.dlq": 1})
    return name


@pytest.fixture
def sink_config(broker: EmbeddedBroker, topic: str, tmp_path: Path) -> SinkConfig:
    return SinkConfig(
        bootstrap_servers=broker.bootstrap_servers,
        root=tmp_path / "traces",
        topic=topic,
        group_id=f"sink-{topic}",
        dead_letter_topic=f"{topic}.dlq",
        flush_records=1_000,
        flush_interval_s=0.5,
        max_trace_bytes=64 * 1024,
    )


@pytest.fixture
def running_sink(sink_config: SinkConfig) -> Iterator[Callable[[], None]]:
    """Starts a sink thread on `sink_config`; stopping it flushes and closes."""
    stop = threading.Event()
    sink = TraceSink(sink_config, registry=CollectorRegistry())
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    thread.start()
    yield lambda: (stop.set(), thread.join(30))
    stop.set()
    thread.join(30)

"""TraceProducer never blocks or raises in `submit`, and counts every trace it could not send."""

import time

import pytest
from prometheus_client import CollectorRegistry

from specloop.storage.broker import free_port
from specloop.storage.producer import TraceProducer
from tests.storage.traces import make_trace

pytestmark = pytest.mark.timeout(60)


def _dropped(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("specloop_traces_dropped_total", {"reason": reason}) or 0.0


def test_submit_stays_fast_and_counts_drops_while_kafka_is_down() -> None:
    registry = CollectorRegistry()
    producer = TraceProducer(f"127.0.0.1:{free_port()}", queue_size=5, registry=registry)
    trace = make_trace("t-down")
    started = time.perf_counter()
    accepted = [producer.submit(trace) for _ in range(50)]
    elapsed = time.perf_counter() - started
    assert elapsed < 0.05, f"50 submits took {elapsed:.3f} s"
    assert 5 <= sum(accepted) <= 6 and _dropped(registry, "queue_full") == 50 - sum(accepted)
    producer.close(timeout=1.0)
    assert not producer.submit(trace)
    # The worker may still sit in a connection attempt (kafka-python probes for ~2 s); it counts
    # what it could not send once that attempt fails.
    deadline = time.monotonic() + 10
    while _lost(registry) < 51 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert registry.get_sample_value("specloop_traces_sent_total") == 0 and _lost(registry) == 51


def _lost(registry: CollectorRegistry) -> float:
    return sum(_dropped(registry, reason) for reason in ("queue_full", "kafka_unavailable", "closed"))


def test_queue_size_is_validated() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        TraceProducer("127.0.0.1:9", queue_size=0, registry=CollectorRegistry())

"""`TraceProducer`: the engine's way onto Kafka, never in the way of serving.

`submit` only puts the trace on a bounded in-process queue (no I/O, no encoding, no lock held for
long); a background thread encodes it and hands it to kafka-python with `acks=all` and
idempotence. When the queue is full (Kafka slow or down), the trace is dropped and counted, never
waited for. Keys are trace ids, so every copy of a trace lands on the same partition and the sink
can dedupe it. kafka-python 3.x runs the idempotent producer (InitProducerId, sequence numbers)
against tansu without error; the sink still dedupes by trace_id, which covers a client that
resends after a broker restart.

This module is not the consent check (the engine captures only consented requests) and not the
sink.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping

from kafka import KafkaProducer
from kafka.errors import KafkaError
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from specloop.storage.schema import Trace

log = logging.getLogger(__name__)

_STOP = object()
_RECONNECT_S = 1.0


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter(
            "specloop_traces_sent_total", "Traces acknowledged by Kafka (acks=all).", registry=registry
        )
        self.dropped = Counter(
            "specloop_traces_dropped_total",
            "Traces that never reached Kafka, by reason.",
            ["reason"],
            registry=registry,
        )
        self.errors = Counter(
            "specloop_trace_producer_errors_total",
            "Kafka client errors seen by the trace producer, by error type.",
            ["error"],
            registry=registry,
        )


class TraceProducer:
    """Asynchronous, bounded, non-blocking trace publisher. Thread-safe; one per process."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "traces",
        *,
        queue_size: int = 10_000,
        registry: CollectorRegistry = REGISTRY,
        kafka_config: Mapping[str, object] | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.topic = topic
        self._config = {
            "bootstrap_servers": bootstrap_servers,
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": 5,
            "max_block_ms": 2_000,
            "bootstrap_timeout_ms": 2_000,
            **(kafka_config or {}),
        }
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._metrics = _Metrics(registry)
        self._closed = threading.Event()
        self._deadline = float("inf")
        self._kafka: KafkaProducer | None = None
        self._thread = threading.Thread(target=self._run, name="trace-producer", daemon=True)
        self._thread.start()

    def submit(self, trace: Trace) -> bool:
        """Queue `trace` for Kafka; False (and a counted drop) when it cannot be queued. Never blocks."""
        if self._closed.is_set():
            self._metrics.dropped.labels("closed").inc()
            return False
        try:
            self._queue.put_nowait(trace)
        except queue.Full:
            self._metrics.dropped.labels("queue_full").inc()
            return False
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (up to `timeout` seconds), then stop; later submits are dropped."""
        if self._closed.is_set():
            return
        self._deadline = time.monotonic() + timeout
        self._closed.set()
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("trace queue still full at close; unsent traces are dropped")
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        if self._thread.is_alive():
            log.warning("trace producer did not drain within %.1f s", timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._send(item)
        self._drain_leftovers()
        if self._kafka is not None:
            self._kafka.close(timeout=max(0.0, self._deadline - time.monotonic()))

    def _drain_leftovers(self) -> None:
        leftover = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            leftover += 1
        if leftover:
            self._metrics.dropped.labels("closed").inc(leftover)

    def _send(self, trace: Trace) -> None:
        if time.monotonic() > self._deadline:
            self._metrics.dropped.labels("closed").inc()
            return
        kafka = self._connect()
        if kafka is None:
            self._metrics.dropped.labels("kafka_unavailable").inc()
            return
        try:
            future = kafka.send(self.topic, key=trace.trace_id.encode(), value=trace.to_json())
        except KafkaError as error:
            self._count_failure(error)
            return
        future.add_callback(self._on_sent).add_errback(self._count_failure)

    def _connect(self) -> KafkaProducer | None:
        """The Kafka client; while no broker answers, retry (the queue absorbs the outage) until close's deadline."""
        while self._kafka is None and time.monotonic() < self._deadline:
            try:
                self._kafka = KafkaProducer(**self._config)
            except KafkaError as error:
                self._metrics.errors.labels(type(error).__name__).inc()
                time.sleep(min(_RECONNECT_S, max(0.0, self._deadline - time.monotonic())))
        return self._kafka

    def _on_sent(self, _: object) -> None:
        self._metrics.sent.inc()

    def _count_failure(self, error: BaseException) -> None:
        self._metrics.errors.labels(type(error).__name__).inc()
        self._metrics.dropped.labels("send_failed").inc()

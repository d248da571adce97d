"""The Kafka -> Parquet sink: a consumer group member that writes traces exactly once in effect.

Per assigned partition the sink buffers one batch: the records from offset `first` up to `next`.
A flush writes the batch's traces as one file per hive directory, every file named
`<topic>+<partition>+<first>` (so one batch spanning two days or two base models yields two files
with the same name in different directories), durably (temp, fsync, rename, dir fsync); it then
waits for the dead-letter sends and only then commits `next`. Hence, per partition:

* files cover exactly the committed offsets, plus at most the one batch being flushed;
* on assignment the sink deletes files of that partition whose `first` is at or after the
  committed offset (a flush that crashed before its commit) and resumes from the committed
  offset, so the replay rewrites those rows once, under the same names when the batch boundaries
  match;
* if the group has no committed offset (a new group id over an existing store), the files are the
  record: the newest batch of the partition is treated as unfinished and replayed.

A crash at any instruction therefore neither loses nor duplicates a row. A write that would replace
a file not removed by that reconciliation means offsets went backwards (a broker that lost its
log); the sink stops rather than overwrite data. Within a batch, copies of a trace_id keep the
first. Messages that are not valid v1 traces go to the dead-letter topic, with the reason and
source coordinates in headers, and never stop the sink (delivery there is at least once).

This module is not the schema (`storage.schema`) or the layout rules (`storage.layout`); one sink
process per partition at a time is assumed (the consumer group provides it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import CommitFailedError
from kafka.structs import OffsetAndMetadata
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field

from storage.layout import hive_dir, remove_durably, sink_file_name, sink_files, write_parquet_atomic
from storage.schema import Trace, TraceRejected, decode_trace, to_arrow, trace_day

log = logging.getLogger(__name__)

DLQ_REASON = "specloop.dlq.reason"
DLQ_SOURCE = "specloop.dlq.source"
DLQ_TRUNCATED = "specloop.dlq.truncated_from"
_DLQ_MAX_VALUE = 64 * 1024
# Connection settings (SASL/TLS) that `kafka_config` passes to the dead-letter producer as well.
_SHARED_CLIENT_SETTINGS = frozenset(
    {
        "client_id",
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "sasl_kerberos_service_name",
        "sasl_oauth_token_provider",
        "ssl_context",
        "ssl_check_hostname",
        "ssl_cafile",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_crlfile",
        "request_timeout_ms",
        "api_version",
    }
)


class SinkConfig(BaseModel):
    """Sink settings, validated once; errors name the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: Annotated[str, Field(min_length=1)]
    root: Path
    topic: str = "traces"
    group_id: str = "specloop-sink"
    dead_letter_topic: str = "traces.dlq"
    flush_records: Annotated[int, Field(ge=1)] = 50_000
    flush_bytes: Annotated[int, Field(ge=1)] = 64 * 1024 * 1024
    flush_interval_s: Annotated[float, Field(gt=0)] = 30.0
    max_trace_bytes: Annotated[int, Field(ge=1)] = 1024 * 1024
    poll_records: Annotated[int, Field(ge=1)] = 5_000
    kafka_config: dict[str, object] = Field(default_factory=dict)


@dataclass
class _Batch:
    """Consumed, not yet committed records of one partition."""

    first_offset: int
    next_offset: int
    traces: dict[str, Trace] = field(default_factory=dict)
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter("specloop_sink_traces_written_total", "Traces made durable in Parquet.", registry=registry)
        self.duplicates = Counter(
            "specloop_sink_duplicates_total", "Repeated trace_ids dropped within a batch.", registry=registry
        )
        self.dead_lettered = Counter(
            "specloop_sink_dead_lettered_total",
            "Messages sent to the dead-letter topic, by reason.",
            ["reason"],
            registry=registry,
        )


class TraceSink:
    """Consumes the trace topic and writes Parquet under `config.root`. Not thread-safe; one loop."""

    def __init__(self, config: SinkConfig, registry: CollectorRegistry = REGISTRY) -> None:
        self.config = config
        self._metrics = _Metrics(registry)
        self._batches: dict[TopicPartition, _Batch] = {}
        self._dead_letters: list = []
        consumer_config = {
            # tansu with kafka-python 3.x: the default session timeout makes a join take ~23 s.
            "session_timeout_ms": 6_000,
            "heartbeat_interval_ms": 2_000,
            "max_partition_fetch_bytes": 16 * 1024 * 1024,
            **config.kafka_config,
        }
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap_servers,
            group_id=config.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **consumer_config,
        )
        self._dead_letter = KafkaProducer(
            bootstrap_servers=config.bootstrap_servers,
            acks="all",
            linger_ms=5,
            **{k: v for k, v in config.kafka_config.items() if k in _SHARED_CLIENT_SETTINGS},
        )
        self._rebalance = _Rebalance()
        self._consumer.subscribe([config.topic], listener=self._rebalance)

    def run(self, stop: threading.Event) -> None:
        """Consume until `stop` is set, then flush what is buffered and close."""
        try:
            while not stop.is_set():
                self.poll_once()
            self.flush()
        finally:
            self.close()

    def poll_once(self, timeout_ms: int = 500) -> int:
        """One poll, then a flush if a size or time limit is reached; returns records consumed."""
        limit = min(self.config.poll_records, self.config.flush_records)
        polled = self._consumer.poll(timeout_ms=timeout_ms, max_records=limit)
        for tp in self._rebalance.take_revoked():
            self._batches.pop(tp, None)
        sought = {tp for tp in self._rebalance.take_assigned() if self._reconcile(tp)}
        count = 0
        for tp, records in polled.items():
            if tp in sought:
                continue  # fetched before the seek; fetched again from the reconciled offset
            for record in records:
                self._accept(tp, record)
            count += len(records)
        if self._should_flush():
            self.flush()
        return count

    def _accept(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        batch = self._batches.get(tp)
        if batch is None:
            batch = self._batches[tp] = _Batch(record.offset, record.offset + 1)
        batch.next_offset = record.offset + 1
        try:
            trace = decode_trace(record.value, self.config.max_trace_bytes)
        except TraceRejected as rejected:
            self._send_dead_letter(record, rejected.reason)
            return
        batch.nbytes += len(record.value)
        if trace.trace_id in batch.traces:
            self._metrics.duplicates.inc()
        else:
            batch.traces[trace.trace_id] = trace

    def _send_dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        value = record.value or b""
        headers = [
            (DLQ_REASON, reason.encode()),
            (DLQ_SOURCE, f"{record.topic}/{record.partition}/{record.offset}".encode()),
        ]
        if len(value) > _DLQ_MAX_VALUE:
            headers.append((DLQ_TRUNCATED, str(len(value)).encode()))
            value = value[:_DLQ_MAX_VALUE]
        future = self._dead_letter.send(self.config.dead_letter_topic, key=record.key, value=value, headers=headers)
        self._dead_letters.append(future)
        self._metrics.dead_lettered.labels(reason.split(":", 1)[0]).inc()
        log.warning("dead-lettered %s/%d/%d: %s", record.topic, record.partition, record.offset, reason)

    def _should_flush(self) -> bool:
        if not self._batches:
            return False
        records = sum(len(b.traces) for b in self._batches.values())
        nbytes = sum(b.nbytes for b in self._batches.values())
        oldest = min(b.started for b in self._batches.values())
        return (
            records >= self.config.flush_records
            or nbytes >= self.config.flush_bytes
            or time.monotonic() - oldest >= self.config.flush_interval_s
        )

    def flush(self) -> None:
        """Make every buffered batch durable, then commit its offsets."""
        if not self._batches:
            return
        started = time.monotonic()
        written = sum(self._write(tp, batch) for tp, batch in self._batches.items())
        self._await_dead_letters()
        offsets = {tp: OffsetAndMetadata(b.next_offset, "", -1) for tp, b in self._batches.items()}
        self._batches.clear()
        try:
            self._consumer.commit(offsets)
        except CommitFailedError as error:
            # The group rebalanced during the flush: the partitions are reassigned and reconciled
            # (these files removed, the records replayed), so nothing is lost or doubled.
            log.warning("commit failed, batch will be replayed: %s", error)
            return
        self._metrics.written.inc(written)
        log.info("flushed %d traces in %.2f s, committed %s", written, time.monotonic() - started, offsets)

    def _write(self, tp: TopicPartition, batch: _Batch) -> int:
        groups: dict[Path, list[Trace]] = defaultdict(list)
        for trace in batch.traces.values():
            groups[hive_dir(self.config.root, trace.base_model, trace_day(trace))].append(trace)
        name = sink_file_name(tp.topic, tp.partition, batch.first_offset)
        for directory, traces in groups.items():
            target = directory / name
            if target.exists():
                raise RuntimeError(f"{target} exists: offsets of {tp} went backwards; refusing to overwrite")
            write_parquet_atomic(target, to_arrow(traces))
        return len(batch.traces)

    def _await_dead_letters(self) -> None:
        """Dead letters must be acknowledged before the offsets that carried them are committed."""
        if not self._dead_letters:
            return
        self._dead_letter.flush()
        for future in self._dead_letters:
            future.get(timeout=0)
        self._dead_letters.clear()

    def _reconcile(self, tp: TopicPartition) -> bool:
        """Undo an unfinished flush of `tp` and seek to where its durable files end; True if it sought."""
        self._batches.pop(tp, None)
        files = sink_files(self.config.root, tp.topic, tp.partition)
        resume = self._consumer.committed(tp)
        if resume is None and files:
            resume = max(f.first_offset for f in files)
        if resume is None:
            return False
        stale = [f.path for f in files if f.first_offset >= resume]
        if stale:
            log.info("removing %d uncommitted files of %s at or after offset %d", len(stale), tp, resume)
            remove_durably(stale)
        self._consumer.seek(tp, resume)
        return True

    def close(self) -> None:
        self._consumer.close(autocommit=False)
        self._dead_letter.close(timeout=10)


class _Rebalance(ConsumerRebalanceListener):
    """Records assignment changes for the sink loop.

    kafka-python 3.x calls listeners on its I/O thread, where a blocking call such as
    `committed()` raises; so the listener only records, and the loop reconciles after `poll`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revoked: set[TopicPartition] = set()
        self._assigned: set[TopicPartition] = set()

    def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        with self._lock:
            self._revoked |= set(revoked)
            self._assigned -= set(revoked)

    def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        with self._lock:
            self._assigned |= set(assigned)

    def take_revoked(self) -> set[TopicPartition]:
        with self._lock:
            taken, self._revoked = self._revoked, set()
        return taken

    def take_assigned(self) -> set[TopicPartition]:
        with self._lock:
            taken, self._assigned = self._assigned, set()
        return taken

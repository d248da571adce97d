"""The Kafka -> Parquet sink: a consumer group member that writes traces exactly once in effect.

Per assigned partition the sink buffers one batch: the records from offset `first` up to `next`.
A flush writes the batch's traces as one file per hive directory, every file named
`<topic>+<partition>+<first>` (so one batch spanning two days or two base models yields two files
with the same name in different directories), durably (temp, fsync, rename, dir fsync); it then
waits for the dead-letter sends and only then commits `next`. Hence, per partition:

* files cover exactly the committed offsets, plus at most the one batch being flushed;
* on assignment the sink deletes files of that partition whose `first` is at or after the
  committed offset (a flush that crashed before its commit) and starts the partition at the
  committed offset, so the replay rewrites those rows once, under the same names when the batch
  boundaries match;
* if the group has no committed offset (a new group id over an existing store), the files are the
  record: the newest batch of the partition is treated as unfinished and replayed.

A crash at any instruction therefore neither loses nor duplicates a row. Every batch is filtered
by the erasure journal (`specloop.storage.erased`) as it is written, under the root's lock held
shared, so a trace of a subject erased while it was in flight, or replayed later, never lands. A
write that would replace a file not removed by that reconciliation means offsets went backwards (a
broker that lost its log); the sink stops rather than overwrite data. Within a batch, copies of a trace_id keep the
first. Messages that are not valid v1 traces, and valid ones that Parquet cannot hold (an int past
int32/int64), go to the dead-letter topic with the reason and source coordinates in headers, and
never stop the sink (delivery there is at least once).

The client is confluent-kafka (librdkafka): its fetching and decompression run in C threads
without the GIL. With kafka-python the same loop reached ~3,000 traces/s, its pure-Python record
unpacking and I/O thread competing with validation for the one interpreter. Validation is one
`decode_row` per record (`Trace`'s rules, token ids parsed by numpy into int32 arrays, see
`specloop.storage.schema`), then `rows_to_arrow` per chunk. Per 256+256-token trace these took 30 + 8 us
of CPU where `Trace.model_validate_json` and Arrow from its Python lists took 54 + 28 us; per
512+512-token trace 46 + 10 us against 90 + 50 us (benchmarks/sink_throughput.py stages, one
short run, load average 2.5). Arrow's own JSON reader would be faster still, but on untrusted
bytes it is unusable: pyarrow 25 segfaults on a `null` line and reads `{..}{..}` on one line as
two rows.

This module is not the schema (`specloop.storage.schema`) or the layout rules (`specloop.storage.layout`); one sink
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

import pyarrow as pa
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field

from specloop.storage.erased import Erasure, journal_path, read_erasures, without_erased
from specloop.storage.layout import hive_dir, remove_durably, shared, sink_file_name, sink_files, write_parquet_atomic
from specloop.storage.schema import TraceRejected, TraceRow, decode_row, rows_to_arrow

log = logging.getLogger(__name__)

DLQ_REASON = "specloop.dlq.reason"
DLQ_SOURCE = "specloop.dlq.source"
DLQ_TRUNCATED = "specloop.dlq.truncated_from"
_DLQ_MAX_VALUE = 64 * 1024
_DLQ_TIMEOUT_S = 30.0
_COMMITTED_TIMEOUT_S = 30.0
# librdkafka settings (by prefix) that `kafka_config` passes to the dead-letter producer as well.
_SHARED_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "client.id", "socket.", "broker.", "api.version")

Partition = tuple[str, int]


class SinkConfig(BaseModel):
    """Sink settings, validated once; errors name the field. `kafka_config` takes librdkafka names."""

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
    # Traces become Arrow this many at a time while a batch fills, not all at the flush, so a
    # batch is not held as many small Python objects and converted cache-cold. With traces as
    # pydantic models this measured, per CPU-second, 64+64 tokens: 20-22k traces vs 14-16k;
    # 256+256: 8.5-11.7k vs 6.7-8.1k (benchmarks/sink_throughput.py, interleaved runs).
    arrow_chunk_traces: Annotated[int, Field(ge=1)] = 200
    kafka_config: dict[str, str | int | float | bool] = Field(default_factory=dict)


_Hive = tuple[str, str]  # (base_model, day): one hive directory


@dataclass(slots=True)
class _Pending:
    """A validated trace not yet in Arrow, with what a dead letter of it needs."""

    row: TraceRow
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class _Batch:
    """Consumed, not yet committed records of one partition, per hive directory.

    Traces wait in `pending` until `arrow_chunk_traces` of them share a directory, then become one
    Arrow table in `tables`; `seen` holds every trace_id of the batch for deduplication.
    """

    first_offset: int
    next_offset: int
    seen: set[str] = field(default_factory=set)
    pending: dict[_Hive, list[_Pending]] = field(default_factory=lambda: defaultdict(list))
    tables: dict[_Hive, list[pa.Table]] = field(default_factory=lambda: defaultdict(list))
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter(
            "specloop_sink_traces_written_total", "Traces made durable in Parquet.", registry=registry
        )
        self.duplicates = Counter(
            "specloop_sink_duplicates_total", "Repeated trace_ids dropped within a batch.", registry=registry
        )
        self.erased = Counter(
            "specloop_sink_erased_total", "Traces dropped because their subject was erased after they were "
            "captured (in flight, or replayed from Kafka).", registry=registry
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
        self._batches: dict[Partition, _Batch] = {}
        self._dead_letter_errors: list[str] = []
        self._journal: list[Erasure] = []
        self._journal_key: tuple[int, int] | None = None
        self._consumer = _client(Consumer, _consumer_settings(config))
        self._dead_letter = _client(Producer, _dead_letter_settings(config))
        self._consumer.subscribe([config.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)

    def run(self, stop: threading.Event) -> None:
        """Consume until `stop` is set, then flush what is buffered and close."""
        try:
            while not stop.is_set():
                self.poll_once()
            self.flush()
        finally:
            self.close()

    def poll_once(self, timeout_s: float = 0.5) -> int:
        """One fetch, then a flush if a size or time limit is reached; returns records consumed."""
        limit = min(self.config.poll_records, self.config.flush_records)
        messages = self._consumer.consume(num_messages=limit, timeout=timeout_s)
        count = 0
        for message in messages:
            if message.error() is None:
                self._accept(message)
                count += 1
            else:
                _log_client_error(message.error())
        if self._should_flush():
            self.flush()
        return count

    def _accept(self, message: Message) -> None:
        offset = message.offset()
        source = (message.topic(), message.partition())
        batch = self._batches.get(source)
        if batch is None:
            batch = self._batches[source] = _Batch(offset, offset + 1)
        batch.next_offset = offset + 1
        value = message.value()
        try:
            row = decode_row(value, self.config.max_trace_bytes)
        except TraceRejected as rejected:
            self._send_dead_letter(source, offset, message.key(), value, rejected.reason)
            return
        if row.trace_id in batch.seen:
            self._metrics.duplicates.inc()
            return
        batch.seen.add(row.trace_id)
        batch.nbytes += len(value)
        hive = row.hive
        pending = batch.pending[hive]
        pending.append(_Pending(row, offset, message.key(), value))
        if len(pending) >= self.config.arrow_chunk_traces:
            self._to_arrow(source, batch, hive)

    def _to_arrow(self, source: Partition, batch: _Batch, hive: _Hive) -> None:
        """Move one directory's pending traces into an Arrow table."""
        entries = batch.pending.pop(hive)
        try:
            table = rows_to_arrow([entry.row for entry in entries])
        except (pa.ArrowException, OverflowError):
            table = rows_to_arrow(self._representable(source, entries))
        if table.num_rows:
            batch.tables[hive].append(table)

    def _representable(self, source: Partition, entries: list[_Pending]) -> list[TraceRow]:
        """The traces Arrow can hold; the others (valid v1, but e.g. a top_k past int32) are dead-lettered."""
        kept = []
        for entry in entries:
            try:
                rows_to_arrow([entry.row])
            except (pa.ArrowException, OverflowError) as error:
                self._send_dead_letter(source, entry.offset, entry.key, entry.value, f"unrepresentable: {error}")
            else:
                kept.append(entry.row)
        return kept

    def _send_dead_letter(
        self, source: Partition, offset: int, key: bytes | None, value: bytes | None, reason: str
    ) -> None:
        value = value or b""
        headers = [(DLQ_REASON, reason.encode()), (DLQ_SOURCE, f"{source[0]}/{source[1]}/{offset}".encode())]
        if len(value) > _DLQ_MAX_VALUE:
            headers.append((DLQ_TRUNCATED, str(len(value)).encode()))
            value = value[:_DLQ_MAX_VALUE]
        self._dead_letter.produce(
            self.config.dead_letter_topic, key=key, value=value, headers=headers, on_delivery=self._on_dead_letter
        )
        self._dead_letter.poll(0)
        self._metrics.dead_lettered.labels(reason.split(":", 1)[0]).inc()
        log.warning("dead-lettered %s/%d/%d: %s", source[0], source[1], offset, reason)

    def _on_dead_letter(self, error: KafkaError | None, _: Message) -> None:
        if error is not None:
            self._dead_letter_errors.append(str(error))

    def _should_flush(self) -> bool:
        if not self._batches:
            return False
        records = sum(len(b.seen) for b in self._batches.values())
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
        written = sum(self._write(source, batch) for source, batch in self._batches.items())
        self._await_dead_letters()
        offsets = [TopicPartition(topic, partition, b.next_offset) for (topic, partition), b in self._batches.items()]
        self._batches.clear()
        try:
            self._commit(offsets)
        except KafkaException as error:
            # A rebalance during the flush reassigns and reconciles these partitions (files removed,
            # records replayed); without one, the next commit covers these offsets. Either way
            # nothing is lost or doubled.
            log.warning("commit failed, batch will be replayed or covered by the next commit: %s", error)
            return
        self._metrics.written.inc(written)
        log.info("flushed %d traces in %.2f s, committed %s", written, time.monotonic() - started, _describe(offsets))

    def _commit(self, offsets: list[TopicPartition]) -> None:
        self._consumer.commit(offsets=offsets, asynchronous=False)

    def _write(self, source: Partition, batch: _Batch) -> int:
        for hive in list(batch.pending):
            self._to_arrow(source, batch, hive)
        name = sink_file_name(source[0], source[1], batch.first_offset)
        written = 0
        # Erasure holds the lock exclusively from journalling to rewriting: a batch that was in
        # flight when a subject was erased loses their rows here, and one written before is erased.
        with shared(self.config.root):
            erasures = self._erasures()
            for (base_model, day), tables in batch.tables.items():
                target = hive_dir(self.config.root, base_model, day) / name
                if target.exists():
                    raise RuntimeError(f"{target} exists: offsets of {source} went backwards; refusing to overwrite")
                table, erased = without_erased(pa.concat_tables(tables), erasures)
                self._metrics.erased.inc(erased)
                if table.num_rows:
                    write_parquet_atomic(target, table)
                written += table.num_rows
        return written

    def _erasures(self) -> list[Erasure]:
        """The journal, read again only when it changed: a deployment's years of erasures are parsed
        once, not at every flush."""
        path = journal_path(self.config.root)
        stat = path.stat() if path.exists() else None
        key = None if stat is None else (stat.st_size, stat.st_mtime_ns)
        if key != self._journal_key:
            self._journal, self._journal_key = read_erasures(self.config.root), key
        return self._journal

    def _await_dead_letters(self) -> None:
        """Dead letters must be acknowledged before the offsets that carried them are committed."""
        remaining = self._dead_letter.flush(_DLQ_TIMEOUT_S)
        if remaining or self._dead_letter_errors:
            errors, self._dead_letter_errors = self._dead_letter_errors, []
            raise RuntimeError(f"dead-letter topic not acknowledged ({remaining} pending, errors {errors[:3]})")

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Undo unfinished flushes of the assigned partitions and start each where its files end."""
        committed = consumer.committed(partitions, timeout=_COMMITTED_TIMEOUT_S)
        for tp in committed:
            if tp.error is not None:  # not knowing the committed offset, reconciling could lose rows
                raise KafkaException(tp.error)
            self._batches.pop((tp.topic, tp.partition), None)
            tp.offset = self._reconcile(tp.topic, tp.partition, None if tp.offset == OFFSET_INVALID else tp.offset)
        consumer.assign(committed)

    def _reconcile(self, topic: str, partition: int, resume: int | None) -> int:
        files = sink_files(self.config.root, topic, partition)
        if resume is None and files:
            resume = max(f.first_offset for f in files)
        if resume is None:
            return OFFSET_INVALID
        stale = [f.path for f in files if f.first_offset >= resume]
        if stale:
            log.info("removing %d uncommitted files of %s/%d from offset %d", len(stale), topic, partition, resume)
            with shared(self.config.root):  # an erasure or expiry must not put one back by rewriting it
                remove_durably(stale)
        return resume

    def _on_revoke(self, _: Consumer, partitions: list[TopicPartition]) -> None:
        """Buffered records of a revoked partition are dropped; its next owner replays them."""
        for tp in partitions:
            self._batches.pop((tp.topic, tp.partition), None)

    def close(self) -> None:
        self._consumer.close()
        self._dead_letter.flush(_DLQ_TIMEOUT_S)


def _consumer_settings(config: SinkConfig) -> dict[str, object]:
    return {
        "bootstrap.servers": config.bootstrap_servers,
        "group.id": config.group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        # tansu: with the default 45 s session timeout a group join after a crash takes as long.
        "session.timeout.ms": 6_000,
        "heartbeat.interval.ms": 2_000,
        "max.partition.fetch.bytes": 16 * 1024 * 1024,
        **config.kafka_config,
    }


def _dead_letter_settings(config: SinkConfig) -> dict[str, object]:
    shared = {k: v for k, v in config.kafka_config.items() if k.startswith(_SHARED_PREFIXES)}
    return {"bootstrap.servers": config.bootstrap_servers, "acks": "all", "linger.ms": 5, **shared}


def _client(kind: type[Consumer] | type[Producer], settings: dict[str, object]) -> Consumer | Producer:
    try:
        return kind(settings)
    except KafkaException as error:
        raise ValueError(f"kafka_config: {error.args[0].str()}") from None


def _log_client_error(error: KafkaError) -> None:
    """Errors delivered as messages are informational (librdkafka retries); fatal ones stop the sink."""
    if error.fatal():
        raise KafkaException(error)
    log.warning("kafka: %s", error)


def _describe(offsets: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}/{tp.partition}@{tp.offset}" for tp in offsets)

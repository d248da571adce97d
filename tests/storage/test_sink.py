"""The sink against the real tansu broker: traces become Parquet rows, bad messages dead letters.

The sink consumes with confluent-kafka (librdkafka); producers here are the project's
`TraceProducer` (kafka-python, as in the engine) and confluent-kafka, so records written by both
clients are ingested.
"""

import json
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from confluent_kafka import Producer
from kafka import KafkaConsumer
from prometheus_client import CollectorRegistry

from specloop.storage.broker import EmbeddedBroker
from specloop.storage.layout import live_files
from specloop.storage.producer import TraceProducer
from specloop.storage.sink import DLQ_REASON, DLQ_SOURCE, SinkConfig, TraceSink
from tests.storage.traces import T0, make_trace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _rows(root: Path) -> list[tuple]:
    files = [str(p) for p in live_files(root)]
    if not files:
        return []
    return duckdb.execute(
        "SELECT trace_id, base_model, created_at, prompt_token_ids FROM read_parquet($f) ORDER BY trace_id",
        {"f": files},
    ).fetchall()


def _wait_for_rows(root: Path, count: int, timeout_s: float = 45.0) -> list[tuple]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = _rows(root)
        if len(rows) >= count:
            return rows
        time.sleep(0.2)
    raise AssertionError(f"expected {count} rows under {root}, found {len(_rows(root))}")


def _dead_letters(broker: EmbeddedBroker, topic: str, count: int) -> list:
    consumer = KafkaConsumer(
        topic, bootstrap_servers=broker.bootstrap_servers, auto_offset_reset="earliest", consumer_timeout_ms=20_000
    )
    found = []
    for record in consumer:
        found.append(record)
        if len(found) == count:
            break
    consumer.close()
    return found


def test_traces_become_hive_partitioned_parquet_rows(
    sink_config: SinkConfig, running_sink: Callable[[], None]
) -> None:
    traces = [make_trace(f"t-{i:03d}", seed=i) for i in range(40)]
    traces += [make_trace("t-other-model", base_model="fp-other"), make_trace("t-next-day", created_at=T0.replace(day=2))]
    registry = CollectorRegistry()
    producer = TraceProducer(sink_config.bootstrap_servers, sink_config.topic, registry=registry)
    assert all(producer.submit(t) for t in traces)
    producer.close(timeout=20)
    assert registry.get_sample_value("specloop_traces_sent_total") == len(traces)

    rows = _wait_for_rows(sink_config.root, len(traces))
    assert [r[0] for r in rows] == sorted(t.trace_id for t in traces)
    by_id = {t.trace_id: t for t in traces}
    assert all(list(r[3]) == by_id[r[0]].prompt_token_ids for r in rows)
    directories = {p.parent.relative_to(sink_config.root).as_posix() for p in live_files(sink_config.root)}
    assert directories == {
        "base_model=fp-test/dt=2025-03-01",
        "base_model=fp-test/dt=2025-03-02",
        "base_model=fp-other/dt=2025-03-01",
    }
    assert all(p.name.startswith(f"{sink_config.topic}+") for p in live_files(sink_config.root))


def test_bad_messages_go_to_the_dead_letter_topic_and_the_sink_keeps_going(
    broker: EmbeddedBroker, sink_config: SinkConfig, running_sink: Callable[[], None]
) -> None:
    valid = json.loads(make_trace("t-valid").to_json())
    bad = {
        b"{not json": "malformed_json",
        json.dumps({**valid, "schema_version": 9}).encode(): "unknown_version",
        json.dumps({**valid, "response_token_ids": "1 2 3"}).encode(): "invalid: response_token_ids",
        json.dumps({**valid, "pad": "x" * sink_config.max_trace_bytes}).encode(): "oversized",
        json.dumps({**valid, "trace_id": "t-huge", "sampling": {**valid["sampling"], "top_k": 2**40}}).encode(): (
            "unrepresentable"
        ),
    }
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "message.max.bytes": 4_000_000})
    for value in bad:
        producer.produce(sink_config.topic, value=value, key=b"bad")
    producer.produce(sink_config.topic, value=make_trace("t-after").to_json(), key=b"t-after")
    assert producer.flush(20) == 0

    rows = _wait_for_rows(sink_config.root, 1)
    assert [r[0] for r in rows] == ["t-after"]
    letters = _dead_letters(broker, sink_config.dead_letter_topic, len(bad))
    reasons = {dict(r.headers)[DLQ_REASON].decode() for r in letters}
    assert sorted(next(r for r in reasons if r.startswith(p)).split(":")[0] for p in bad.values()) == sorted(
        p.split(":")[0] for p in bad.values()
    )
    assert all(dict(r.headers)[DLQ_SOURCE].decode().startswith(f"{sink_config.topic}/") for r in letters)


def test_traces_from_confluent_kafka_are_ingested(
    broker: EmbeddedBroker, sink_config: SinkConfig, running_sink: Callable[[], None]
) -> None:
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "acks": "all", "enable.idempotence": True})
    traces = [make_trace(f"cf-{i}", seed=i) for i in range(25)]
    for trace in traces:
        producer.produce(sink_config.topic, key=trace.trace_id.encode(), value=trace.to_json())
    assert producer.flush(20) == 0
    rows = _wait_for_rows(sink_config.root, len(traces))
    assert [r[0] for r in rows] == sorted(t.trace_id for t in traces)


def test_a_trace_sent_twice_in_one_batch_is_written_once(
    broker: EmbeddedBroker, sink_config: SinkConfig, running_sink: Callable[[], None]
) -> None:
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    trace = make_trace("t-twice")
    for _ in range(2):
        producer.produce(sink_config.topic, key=trace.trace_id.encode(), value=trace.to_json())
    producer.produce(sink_config.topic, key=b"t-marker", value=make_trace("t-marker").to_json())
    assert producer.flush(20) == 0
    time.sleep(0.2)
    rows = _wait_for_rows(sink_config.root, 2)
    assert sorted(r[0] for r in rows) == ["t-marker", "t-twice"]


def test_an_unknown_client_setting_is_a_value_error_naming_kafka_config(tmp_path: Path) -> None:
    config = SinkConfig(bootstrap_servers="127.0.0.1:9", root=tmp_path, kafka_config={"no.such.setting": 1})
    with pytest.raises(ValueError, match="kafka_config.*no.such.setting"):
        TraceSink(config, registry=CollectorRegistry())


def test_a_trace_in_flight_when_its_subject_was_erased_never_lands(
    sink_config: SinkConfig, running_sink: Callable[[], None]
) -> None:
    from datetime import UTC, datetime, timedelta

    from specloop.storage.erased import CLOCK_MARGIN, record_erasure
    from tests.storage.traces import SUBJECT_B

    sink_config.root.mkdir(parents=True)
    erased_at = datetime.now(UTC)
    record_erasure(sink_config.root, "acme", make_trace().subject, erased_at)
    traces = [make_trace("in-flight", created_at=erased_at - timedelta(seconds=2)),  # captured before the erasure
              make_trace("granted-again", created_at=erased_at + CLOCK_MARGIN + timedelta(seconds=1)),
              make_trace("someone-else", created_at=erased_at - timedelta(seconds=2), subject=SUBJECT_B)]
    producer = TraceProducer(sink_config.bootstrap_servers, sink_config.topic, registry=CollectorRegistry())
    assert all(producer.submit(t) for t in traces)
    producer.close(timeout=20)

    _wait_for_rows(sink_config.root, 2)
    time.sleep(1.5)  # three flush intervals: the erased trace had its chance to land
    assert [r[0] for r in _rows(sink_config.root)] == ["granted-again", "someone-else"]

"""Sink throughput: traces/s from Kafka (embedded tansu, memory storage) into durable Parquet.

For each trace shape, in one run: pre-produce N traces, then

* end to end, `--repeats` times, two variants interleaved: one in-process `TraceSink` (a fresh
  consumer group each time) timed from its first consumed record until every trace is committed in
  Parquet (group join excluded; fetch, validation, Arrow build, zstd Parquet, fsync and commit
  included), converting traces to Arrow all at the flush (as the sink did before) or every
  `arrow_chunk_traces` (as it does now); best and median of each;
* per stage, on the same records: reading them with kafka-python (the sink's old client) and with
  confluent-kafka (its client now), from `assign` (so wall time includes ~0.6 s of connection
  setup; compare their CPU figures), `Trace` validation, Arrow build, and the durable Parquet write.

The kafka-python sink itself is gone; its figures from this machine are kept in `BEFORE`.
Each figure is given as wall-clock traces/s and as traces per CPU-second of this process (all its
threads; the broker runs in another process): on the shared 2-core machine the wall figure moves
with other people's load, the CPU figure much less. The load average is recorded at start and end.
Target: >= 10,000 traces/s. Writes `benchmarks/results/sink_throughput.json`.

Usage: `.venv/bin/python benchmarks/sink_throughput.py [--traces 30000] [--repeats 3]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from kafka import KafkaConsumer
from kafka import TopicPartition as KafkaTopicPartition
from prometheus_client import CollectorRegistry

from storage.broker import EmbeddedBroker, ensure_topics
from storage.layout import write_parquet_atomic
from storage.schema import SamplingParams, SpecStats, Trace, decode_trace, to_arrow
from storage.sink import SinkConfig, TraceSink

RESULTS = Path(__file__).parent / "results" / "sink_throughput.json"
SHAPES = {"short (64+64 tokens)": (64, 64), "long (256+256 tokens)": (256, 256)}
PARTITIONS = 3
FLUSH_RECORDS = 20_000
CHUNK = SinkConfig.model_fields["arrow_chunk_traces"].default
# The sink's Arrow conversion, side by side: the whole batch at its flush (as before) vs in chunks.
VARIANTS = {"confluent, arrow at flush": FLUSH_RECORDS, f"confluent, arrow every {CHUNK} traces (now)": CHUNK}
# The kafka-python sink, measured on this machine before the switch (load average 7.5).
BEFORE = {"short (64+64 tokens)": 3201, "long (256+256 tokens)": 2919}


def _trace(rng: random.Random, prompt_len: int, response_len: int, at: datetime) -> Trace:
    return Trace(
        trace_id=uuid.uuid4().hex,
        created_at=at,
        finished_at=at + timedelta(milliseconds=400),
        tenant="bench",
        subject=f"{rng.getrandbits(256):064x}",
        consent_id="consent-bench",
        consent_policy_version="2025-01",
        base_model="fp-bench",
        drafter_version="1",
        endpoint="/v1/chat/completions",
        sampling=SamplingParams(temperature=0.7, top_p=0.95, top_k=0, max_tokens=512, seed=None),
        prompt_token_ids=[rng.randrange(49152) for _ in range(prompt_len)],
        response_token_ids=[rng.randrange(49152) for _ in range(response_len)],
        spec=SpecStats(drafts=40, draft_tokens=640, accepted_tokens=300),
        finish_reason="stop",
    )


def _produce(servers: str, topic: str, count: int, shape: tuple[int, int]) -> int:
    rng = random.Random(0)
    settings = {"bootstrap.servers": servers, "acks": "all", "linger.ms": 20, "queue.buffering.max.messages": count}
    producer = Producer(settings)
    at = datetime(2025, 3, 1, tzinfo=UTC)
    payload_bytes = 0
    for i in range(count):
        trace = _trace(rng, *shape, at + timedelta(seconds=i))
        value = trace.to_json()
        payload_bytes += len(value)
        producer.produce(topic, key=trace.trace_id.encode(), value=value)
        producer.poll(0)
    assert producer.flush(60) == 0
    return payload_bytes


def _end_to_end(servers: str, topic: str, count: int, root: Path, arrow_chunk: int) -> dict[str, float]:
    config = SinkConfig(
        bootstrap_servers=servers, root=root, topic=topic, group_id=f"bench-{uuid.uuid4().hex[:6]}",
        dead_letter_topic=f"{topic}.dlq", flush_records=FLUSH_RECORDS, flush_interval_s=5.0,
        arrow_chunk_traces=arrow_chunk,
    )  # fmt: skip
    registry = CollectorRegistry()
    sink = TraceSink(config, registry=registry)
    try:
        while sink.poll_once(timeout_s=0.2) == 0:
            pass  # the group join, not timed
        wall, cpu = time.perf_counter(), time.process_time()
        while (registry.get_sample_value("specloop_sink_traces_written_total") or 0) < count:
            if sink.poll_once(timeout_s=0.2) == 0:
                sink.flush()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        sink.close()
    return {"traces_per_s": round(count / wall), "traces_per_cpu_s": round(count / cpu)}


def _summary(runs: list[dict[str, float]]) -> dict[str, object]:
    wall = sorted(r["traces_per_s"] for r in runs)
    return {
        "runs": runs,
        "best_traces_per_s": wall[-1],
        "median_traces_per_s": round(statistics.median(wall)),
        "median_traces_per_cpu_s": round(statistics.median(r["traces_per_cpu_s"] for r in runs)),
        "meets_10k_target_best": wall[-1] >= 10_000,
    }


class _Clock:
    """Wall and CPU seconds summed over the `with` blocks it times."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def __exit__(self, *_: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu

    def rates(self, count: int) -> dict[str, float]:
        return {
            "traces_per_s": round(count / self.wall),
            "traces_per_cpu_s": round(count / self.cpu),
            "us_per_trace_cpu": round(self.cpu / count * 1e6, 1),
        }


def _read_confluent(servers: str, topic: str, count: int, clock: _Clock) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": servers, "group.id": "bench-read", "enable.auto.commit": False})
    values: list[bytes] = []
    with clock:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        while len(values) < count:
            values.extend(m.value() for m in consumer.consume(5_000, timeout=1.0) if m.error() is None)
    consumer.close()
    return values


def _read_kafka_python(servers: str, topic: str, count: int, clock: _Clock) -> None:
    consumer = KafkaConsumer(
        bootstrap_servers=servers, enable_auto_commit=False, max_partition_fetch_bytes=16 * 1024 * 1024
    )
    partitions = [KafkaTopicPartition(topic, p) for p in range(PARTITIONS)]
    read = 0
    with clock:
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        while read < count:
            read += sum(len(records) for records in consumer.poll(timeout_ms=1_000, max_records=5_000).values())
    consumer.close()


def _stages(servers: str, topic: str, count: int, scratch: Path) -> dict[str, dict[str, float]]:
    """Each stage's cost; validation and Arrow alternate in chunks of `CHUNK`, as in the sink."""
    stages, old_client, new_client = {}, _Clock(), _Clock()
    _read_kafka_python(servers, topic, count, old_client)
    stages["read: kafka-python"] = old_client.rates(count)
    values = _read_confluent(servers, topic, count, new_client)
    stages["read: confluent-kafka"] = new_client.rates(count)
    validate, arrow = _Clock(), _Clock()
    tables = []
    for start in range(0, count, CHUNK):
        with validate:
            traces = [decode_trace(value, 1 << 20) for value in values[start : start + CHUNK]]
        with arrow:
            tables.append(to_arrow(traces))
    stages["validate: Trace.model_validate_json"] = validate.rates(count)
    stages["arrow: to_arrow"] = arrow.rates(count)
    clock = _Clock()
    with clock:
        write_parquet_atomic(scratch / "stage.parquet", pa.concat_tables(tables))
    stages["parquet: zstd + fsync + rename"] = clock.rates(count)
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    results = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as scratch:
        for name, shape in SHAPES.items():
            topic = f"bench-{uuid.uuid4().hex[:6]}"
            ensure_topics(broker.bootstrap_servers, {topic: PARTITIONS, f"{topic}.dlq": 1})
            payload = _produce(broker.bootstrap_servers, topic, args.traces, shape)
            runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
            for repeat in range(args.repeats):
                for variant, chunk in VARIANTS.items():  # interleaved, so load drifts hit both alike
                    root = Path(scratch) / f"{topic}-{chunk}-{repeat}"
                    runs[variant].append(_end_to_end(broker.bootstrap_servers, topic, args.traces, root, chunk))
                    print(name, variant, json.dumps(runs[variant][-1]), f"load {os.getloadavg()[0]:.1f}", flush=True)
            parquet = sum(p.stat().st_size for p in (Path(scratch) / f"{topic}-{CHUNK}-0").rglob("*.parquet"))
            results.append(
                {
                    "shape": name,
                    "traces": args.traces,
                    "json_bytes_per_trace": round(payload / args.traces),
                    "parquet_bytes_per_trace": round(parquet / args.traces),
                    "before_kafka_python_sink_traces_per_s": BEFORE[name],
                    "end_to_end": {variant: _summary(variant_runs) for variant, variant_runs in runs.items()},
                    "stages": _stages(broker.bootstrap_servers, topic, args.traces, Path(scratch)),
                }
            )
            print(json.dumps(results[-1], indent=1), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "sink_throughput",
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
                "load_average_1_5_15m_at_start": [round(x, 2) for x in load_at_start],
                "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
                "broker": f"tansu memory storage, {PARTITIONS} partitions, loopback",
                "sink_client": "confluent-kafka (librdkafka); before: kafka-python",
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

"""Sink throughput: traces/s from Kafka (embedded tansu, memory storage) into durable Parquet.

For each trace shape (64+64, 256+256 and 512+512 prompt+response tokens), in one run: pre-produce
N traces, then

* end to end, `--repeats` times: one in-process `TraceSink` (a fresh consumer group each time)
  timed from its first consumed record until every trace is committed in Parquet (group join
  excluded; fetch, validation, Arrow build, zstd Parquet, fsync and commit included); best and
  median;
* per stage, on the same records: reading them with confluent-kafka from `assign` (so wall time
  includes ~0.6 s of connection setup; read its CPU figure), validation and Arrow build the way the
  sink did before (`Trace.model_validate_json`, `to_arrow` from Python lists) and does now
  (`decode_row`, `rows_to_arrow` from int32 arrays), alternating in chunks of `arrow_chunk_traces`
  as in the sink, and the durable Parquet write.

Earlier sinks are gone; their end-to-end figures from this machine are kept in `BEFORE`.
Each figure is given as wall-clock traces/s and as traces per CPU-second of this process (all its
threads; the broker runs in another process): on the shared 2-core machine the wall figure moves
with other people's load, the CPU figure much less. The load average is recorded at start and end.
Target: >= 10,000 traces/s. Writes `benchmarks/results/sink_throughput.json`.

Usage: `.venv/bin/python benchmarks/sink_throughput.py [--traces 30000] [--repeats 3] [--shapes short,long,xl]
[--out PATH]`
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
from prometheus_client import CollectorRegistry

from specloop.storage.broker import EmbeddedBroker, ensure_topics
from specloop.storage.layout import write_parquet_atomic
from specloop.storage.schema import (
    Trace,
    TraceSampling,
    TraceSpecStats,
    decode_row,
    decode_trace,
    rows_to_arrow,
    to_arrow,
)
from specloop.storage.sink import SinkConfig, TraceSink

RESULTS = Path(__file__).parent / "results" / "sink_throughput.json"
SHAPES = {"short": ("short (64+64 tokens)", (64, 64)), "long": ("long (256+256 tokens)", (256, 256)),
          "xl": ("xl (512+512 tokens)", (512, 512))}
PARTITIONS = 3
FLUSH_RECORDS = 20_000
CHUNK = SinkConfig.model_fields["arrow_chunk_traces"].default
# Median end-to-end traces/s of earlier sinks on this machine: kafka-python (load average 7.5), and
# confluent-kafka validating into pydantic `Trace`s (load average 4.0-4.6, 2026-11-29).
BEFORE = {
    "short (64+64 tokens)": {"kafka-python sink": 3201, "pydantic Trace sink": 12919},
    "long (256+256 tokens)": {"kafka-python sink": 2919, "pydantic Trace sink": 6076},
    "xl (512+512 tokens)": {},
}


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
        sampling=TraceSampling(temperature=0.7, top_p=0.95, top_k=0, max_tokens=512, seed=None),
        prompt_token_ids=[rng.randrange(49152) for _ in range(prompt_len)],
        response_token_ids=[rng.randrange(49152) for _ in range(response_len)],
        spec=TraceSpecStats(drafts=40, draft_tokens=640, accepted_tokens=300),
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


def _end_to_end(servers: str, topic: str, count: int, root: Path) -> dict[str, float]:
    config = SinkConfig(
        bootstrap_servers=servers, root=root, topic=topic, group_id=f"bench-{uuid.uuid4().hex[:6]}",
        dead_letter_topic=f"{topic}.dlq", flush_records=FLUSH_RECORDS, flush_interval_s=5.0,
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
    """Wall and CPU seconds summed over the `with` blocks it times.

    CPU is the whole process's by default (librdkafka reads and Arrow compresses on threads of
    their own); `thread_only` counts this thread alone, for pure-Python stages, which the idle
    background threads of closed Kafka clients would otherwise inflate.
    """

    def __init__(self, thread_only: bool = False) -> None:
        self.wall = self.cpu = 0.0
        self._cpu_clock = time.thread_time if thread_only else time.process_time

    def __enter__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), self._cpu_clock()

    def __exit__(self, *_: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += self._cpu_clock() - self._cpu

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


def _stages(servers: str, topic: str, count: int, scratch: Path) -> dict[str, dict[str, float]]:
    """Each stage's cost; validation and Arrow alternate in chunks of `CHUNK`, as in the sink."""
    stages, read = {}, _Clock()
    values = _read_confluent(servers, topic, count, read)
    stages["read: confluent-kafka"] = read.rates(count)
    clocks = {name: _Clock(thread_only=True) for name in ("validate", "arrow", "decode_row", "rows_to_arrow")}
    tables = []
    for start in range(0, count, CHUNK):
        chunk = values[start : start + CHUNK]
        with clocks["validate"]:
            traces = [decode_trace(value, 1 << 20) for value in chunk]
        with clocks["arrow"]:
            to_arrow(traces)
        with clocks["decode_row"]:
            rows = [decode_row(value, 1 << 20) for value in chunk]
        with clocks["rows_to_arrow"]:
            tables.append(rows_to_arrow(rows))
    stages["validate before: Trace.model_validate_json"] = clocks["validate"].rates(count)
    stages["arrow before: to_arrow (Python lists)"] = clocks["arrow"].rates(count)
    stages["validate now: decode_row"] = clocks["decode_row"].rates(count)
    stages["arrow now: rows_to_arrow (int32 arrays)"] = clocks["rows_to_arrow"].rates(count)
    clock = _Clock()
    with clock:
        write_parquet_atomic(scratch / "stage.parquet", pa.concat_tables(tables))
    stages["parquet: zstd + fsync + rename"] = clock.rates(count)
    return stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes (short trial runs: elsewhere)")
    args = parser.parse_args()
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}, known {list(SHAPES)}")
    load_at_start = os.getloadavg()
    results = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as scratch:
        for name, shape in (SHAPES[key] for key in args.shapes.split(",")):
            topic = f"bench-{uuid.uuid4().hex[:6]}"
            ensure_topics(broker.bootstrap_servers, {topic: PARTITIONS, f"{topic}.dlq": 1})
            payload = _produce(broker.bootstrap_servers, topic, args.traces, shape)
            runs = []
            for repeat in range(args.repeats):
                root = Path(scratch) / f"{topic}-{repeat}"
                runs.append(_end_to_end(broker.bootstrap_servers, topic, args.traces, root))
                print(name, json.dumps(runs[-1]), f"load {os.getloadavg()[0]:.1f}", flush=True)
            parquet = sum(p.stat().st_size for p in (Path(scratch) / f"{topic}-0").rglob("*.parquet"))
            results.append(
                {
                    "shape": name,
                    "traces": args.traces,
                    "json_bytes_per_trace": round(payload / args.traces),
                    "parquet_bytes_per_trace": round(parquet / args.traces),
                    "before_median_traces_per_s": BEFORE[name],
                    "end_to_end": _summary(runs),
                    "stages": _stages(broker.bootstrap_servers, topic, args.traces, Path(scratch)),
                }
            )
            print(json.dumps(results[-1], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "sink_throughput",
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
                "load_average_1_5_15m_at_start": [round(x, 2) for x in load_at_start],
                "load_average_1_5_15m_at_end": [round(x, 2) for x in os.getloadavg()],
                "broker": f"tansu memory storage, {PARTITIONS} partitions, loopback",
                "sink": "confluent-kafka (librdkafka), decode_row + rows_to_arrow",
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

"""Sink throughput: traces/s from Kafka (embedded tansu, memory storage) into durable Parquet.

For each trace shape, in one run: pre-produce N traces with kafka-python, then time one in-process
`TraceSink` from its first consumed record until every trace is committed in Parquet (group join
excluded; decode, validation, Arrow build, zstd Parquet, fsync and commit included). Target:
>= 10,000 traces/s. Writes `benchmarks/results/sink_throughput.json`.

Usage: `.venv/bin/python benchmarks/sink_throughput.py [--traces 50000]`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from kafka import KafkaProducer
from prometheus_client import CollectorRegistry

from storage.broker import EmbeddedBroker, ensure_topics
from storage.schema import SamplingParams, SpecStats, Trace
from storage.sink import SinkConfig, TraceSink

RESULTS = Path(__file__).parent / "results" / "sink_throughput.json"
SHAPES = {"short (64+64 tokens)": (64, 64), "long (256+256 tokens)": (256, 256)}


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
    producer = KafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=20, batch_size=512 * 1024)
    at = datetime(2025, 3, 1, tzinfo=UTC)
    payload_bytes = 0
    for i in range(count):
        trace = _trace(rng, *shape, at + timedelta(seconds=i))
        value = trace.to_json()
        payload_bytes += len(value)
        producer.send(topic, key=trace.trace_id.encode(), value=value)
    producer.flush()
    producer.close()
    return payload_bytes


def _measure(servers: str, topic: str, count: int, root: Path) -> float:
    config = SinkConfig(
        bootstrap_servers=servers, root=root, topic=topic, group_id=f"bench-{topic}",
        dead_letter_topic=f"{topic}.dlq", flush_records=20_000, flush_interval_s=5.0,
    )  # fmt: skip
    registry = CollectorRegistry()
    sink = TraceSink(config, registry=registry)
    started = None
    try:
        while (registry.get_sample_value("specloop_sink_traces_written_total") or 0) < count:
            consumed = sink.poll_once(timeout_ms=200)
            if started is None and consumed:
                started = time.perf_counter()
            if started is not None and consumed == 0:
                sink.flush()
        return time.perf_counter() - started
    finally:
        sink.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=50_000)
    args = parser.parse_args()
    results = []
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as scratch:
        for name, shape in SHAPES.items():
            topic = f"bench-{uuid.uuid4().hex[:6]}"
            ensure_topics(broker.bootstrap_servers, {topic: 3, f"{topic}.dlq": 1})
            payload = _produce(broker.bootstrap_servers, topic, args.traces, shape)
            seconds = _measure(broker.bootstrap_servers, topic, args.traces, Path(scratch) / topic)
            parquet = sum(p.stat().st_size for p in (Path(scratch) / topic).rglob("*.parquet"))
            results.append(
                {
                    "shape": name,
                    "traces": args.traces,
                    "seconds": round(seconds, 3),
                    "traces_per_s": round(args.traces / seconds),
                    "json_mb_per_s": round(payload / seconds / 1e6, 1),
                    "parquet_bytes_per_trace": round(parquet / args.traces),
                    "meets_10k_target": args.traces / seconds >= 10_000,
                }
            )
            print(json.dumps(results[-1]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "sink_throughput",
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
                "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                "broker": "tansu memory storage, 3 partitions, loopback",
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

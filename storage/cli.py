"""The storage commands of `specloop`: `sink`, `compact`, `broker` and `registry add-reader`.

`register(app)` adds them to the one typer app (`specloop.daemon.cli`), which also sets up logging. Each
command validates its options, then calls one function of the storage package; no storage logic
lives here.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

_SERVERS = typer.Option(help="Kafka bootstrap servers, host:port[,host:port]")
_ROOT = typer.Option(help="Root directory of the trace Parquet files")
READER_PASSWORD = "SPECLOOP_REGISTRY_READER_PASSWORD"


registry_app = typer.Typer(help="The drafter registry's users (an MLflow server with its basic-auth app)",
                           no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("sink")(sink)
    app.command("compact")(compact)
    app.command("broker")(broker)
    app.add_typer(registry_app, name="registry")


@registry_app.command("add-reader")
def add_reader(
    username: Annotated[str, typer.Option(help="The user engines log in as")],
    registry: Annotated[str, typer.Option(envvar="SPECLOOP_REGISTRY", help="The MLflow server (http://...)")],
) -> None:
    """Create (or set the password of) a registry user that reads every drafter and writes none. Its
    password comes from SPECLOOP_REGISTRY_READER_PASSWORD (never a flag, which `ps` would show); the
    command runs as the server's admin: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD."""
    from specloop.storage.registry import add_reader as add

    password = os.environ.get(READER_PASSWORD)
    if not password:
        raise typer.BadParameter(f"set {READER_PASSWORD} to the new user's password")
    try:
        result = add(registry, username, password)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    typer.echo(f"registry user {username} {result}")


def sink(
    bootstrap_servers: Annotated[str, _SERVERS],
    root: Annotated[Path, _ROOT],
    topic: str = "traces",
    group_id: str = "specloop-sink",
    dead_letter_topic: str = "traces.dlq",
    flush_records: int = 50_000,
    flush_interval_s: float = 30.0,
    max_trace_bytes: int = 1024 * 1024,
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus metrics here; 0 = off")] = 0,
    kafka_config: Annotated[
        str, typer.Option(help='JSON object of extra librdkafka settings, e.g. {"security.protocol": "SASL_SSL"}')
    ] = "{}",
) -> None:
    """Consume traces from Kafka into hive-partitioned Parquet until SIGTERM or SIGINT."""
    from prometheus_client import start_http_server

    from specloop.storage.broker import ensure_topics
    from specloop.storage.sink import SinkConfig, TraceSink

    try:
        config = SinkConfig(
            bootstrap_servers=bootstrap_servers,
            root=root,
            topic=topic,
            group_id=group_id,
            dead_letter_topic=dead_letter_topic,
            flush_records=flush_records,
            flush_interval_s=flush_interval_s,
            max_trace_bytes=max_trace_bytes,
            kafka_config=_json_object(kafka_config, "--kafka-config"),
        )
        sink = TraceSink(config)
    except ValueError as error:  # pydantic's ValidationError included; each names the field
        raise typer.BadParameter(str(error)) from None
    if metrics_port:
        start_http_server(metrics_port, addr="127.0.0.1")
    ensure_topics(bootstrap_servers, {dead_letter_topic: 1})
    sink.run(_stop_on_signal())


def compact(root: Annotated[Path, _ROOT], min_files: int = 2) -> None:
    """Merge the small Parquet files of each hive directory, rows unchanged."""
    from specloop.storage.compaction import compact as run_compaction

    result = run_compaction(root, min_files)
    typer.echo(f"merged {result.sources_removed} files ({result.rows} rows) into {len(result.merged_files)}")


def broker(
    storage: Annotated[str, typer.Option(help="memory (lost on restart) or s3 (local moto, durable)")] = "memory",
    port: int = 9092,
) -> None:
    """Run the embedded tansu broker in the foreground until SIGTERM or SIGINT."""
    from specloop.storage.broker import EmbeddedBroker, LocalS3

    if storage not in ("memory", "s3"):
        raise typer.BadParameter(f"storage must be memory or s3, got {storage!r}", param_hint="--storage")
    stop = _stop_on_signal()
    s3 = LocalS3().start() if storage == "s3" else None
    try:
        with EmbeddedBroker(s3=s3, port=port) as running:
            typer.echo(f"tansu ({storage}) listening on {running.bootstrap_servers}")
            stop.wait()
    finally:
        if s3 is not None:
            s3.stop()


def _json_object(text: str, option: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"not JSON: {error}", param_hint=option) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=option)
    return value



def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    return stop

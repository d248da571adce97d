"""`specloop up`: the whole single-machine stack in one command, what `make run` starts.

It starts the embedded tansu broker (memory storage; `--durable` puts it on S3 storage against a
local moto server, so a broker restart keeps topics and offsets, though moto itself keeps them in
memory only), creates the trace topics, starts the sink (`python -m specloop.daemon.cli sink`, its own
process) writing Parquet under the consent settings' traces root (`data/traces`), then serves the
model with trace capture pointed at the broker, drafting with the `champion` drafter of the embedded
MLflow registry (`data/registry/`, SQLite and local artifacts), which the shipped drafter seeds
(`daemon/shipped_drafters.py`) when it holds none for the served model. SIGINT or SIGTERM stops it in dependency order:
the server drains requests and flushes capture, then the sink writes and commits what it holds,
then the broker and moto stop. Ctrl-C in a terminal signals the whole foreground process group;
the children must not act on it, or the broker would be gone before the server's last traces
reach it (measured: all three traces of a run lost, and 10 s of shutdown spent retrying). So the
sink runs in its own session and the broker and moto start with SIGINT blocked (a blocked signal
stays blocked across exec); all three are stopped with SIGTERM, in order. If `up` itself is killed
outright, the kernel sends them SIGTERM (`storage/child_process.py`).

This file only starts and stops processes; serving, capture and the sink live in their packages.
Beyond one machine, run `specloop serve --kafka-bootstrap ...` and `specloop sink` against a real
Kafka cluster instead.
"""

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING, Annotated, Literal

import typer

from specloop.consent.settings import SECRETS_FILE
from specloop.daemon.child_command import specloop_command
from specloop.storage.broker import free_port
from specloop.storage.child_process import die_with_parent

if TYPE_CHECKING:
    from specloop.consent.settings import ConsentConfig
    from specloop.engine.server.settings import ServerSettings

log = logging.getLogger(__name__)

TRACE_PARTITIONS = 3  # tansu cannot add partitions later; 3 lets up to 3 sinks share the topic
DEAD_LETTER_TOPIC = "traces.dlq"
SINK_GROUP = "specloop-sink"
_SINK_FLUSH_S = 10  # a developer sees a request's trace in Parquet within seconds, not the default 30
_SINK_READY_S = 60  # joining the group took 3.5 s against tansu here
# At stop, the server's last traces are on the broker once capture has flushed; the sink fetches with
# a 0.5 s poll, so this leaves it time to read them before SIGTERM makes it write what it holds.
_SINK_CATCH_UP_S = 2.0
_SINK_STOP_S = 60
# A run in training stops within about 10 steps of SIGTERM (daemon/retrain/challenger.py).
_DAEMON_STOP_S = 90
POLICIES = Path(__file__).resolve().parent / "policies"  # package data: `specloop up` runs outside a checkout
DEMO_TENANT = "demo"
# The demo traffic's prompt sets (`daemon/training/prompts.py`); formal-logic is the default, the
# narrow domain where one cycle reached +50% τ (daemon/training/prompt_sets/README.md).
DemoPrompts = Literal["formal-logic", "humaneval", "file"]
_DEMO_CONCURRENCY = 4
_DEMO_WAIT_S = 600  # the replay starts with the server, which loads the model first
_DEMO_TENANTS = """# Written by `specloop up --demo`: the demo tenant captures consented traffic; anyone else, with no
# key or any other key, is anonymous (never captured).
allow_anonymous: true
anonymous_unknown_keys: true
tenants:
  - name: demo
    api_keys: ["{key}"]
    capture_allowed: true
    policy_version: "demo-1"
"""


class _Stopped(Exception):
    """A stop signal arrived; unwinds the main thread through the ordered shutdown."""


def register(app: typer.Typer) -> None:
    app.command("up")(up)


def up(
    model: Annotated[str | None, typer.Option(help="HF model directory or .gguf file (default: SmolLM2 GGUF)")] = None,
    host: Annotated[str | None, typer.Option(help="Interface to bind (default: 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (default: 8000)")] = None,
    durable: Annotated[bool, typer.Option(help="Broker on S3 storage (local moto) instead of memory")] = False,
    broker_port: Annotated[int, typer.Option(help="Broker port; 0 picks a free one")] = 0,
    retrain: Annotated[bool, typer.Option(help="Also run the retraining daemon and the MLflow UI")] = True,
    demo: Annotated[bool, typer.Option(help="Send consented demo traffic and retrain on it (demo policy)")]
    = False,
    demo_prompts: Annotated[DemoPrompts, typer.Option(
        help="The demo traffic's prompt set: formal-logic (narrow and templated: the +50% τ case), humaneval "
             "(code) or file (--demo-prompts-file)")] = "formal-logic",
    demo_prompts_file: Annotated[Path | None, typer.Option(
        help='--demo-prompts file: a JSONL of {"messages": [...]} per line')] = None,
    mlflow_port: Annotated[int, typer.Option(help="MLflow UI port; 0 picks a free one")] = 5000,
    daemon_port: Annotated[int, typer.Option(help="The daemon's /health and /metrics port; 0 picks one")] = 8100,
) -> None:
    """Run broker, sink, server with trace capture, and the retraining daemon, until SIGINT/SIGTERM."""
    from specloop.consent.settings import ConsentSettings
    from specloop.engine.server.cli import load_settings, run_server

    _check_demo_prompts(demo_prompts, demo_prompts_file)
    broker_port = broker_port or free_port()
    options = {k: v for k, v in {"model": model, "host": host, "port": port}.items() if v is not None}
    settings = load_settings({**options, "kafka_bootstrap": f"127.0.0.1:{broker_port}"})
    consent_settings = ConsentSettings()
    data = consent_settings.data_dir
    demo_key = _demo_tenant(data) if demo else None  # before the server reads SPECLOOP_TENANTS_FILE
    if demo:  # a line per request would bury the daemon's progress; /metrics counts requests
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    consent = consent_settings.resolve()
    if settings.drafter is None and settings.registry is None:
        settings = load_settings({**options, "kafka_bootstrap": settings.kafka_bootstrap,
                                  "registry": _embedded_registry(data)})
    _handle_stop_signals(_raise_stopped)
    with ExitStack() as stack:
        try:
            _start_broker(stack, durable, broker_port, settings.kafka_topic, data / "logs")
            _start_sink(stack, settings.kafka_bootstrap, settings.kafka_topic, consent.traces_root)
            log.info("consent admin API under /admin; its token is in %s (or SPECLOOP_ADMIN_TOKEN)",
                     data / SECRETS_FILE)
            engine_url = f"http://{settings.host}:{settings.port}"
            daemon_port = daemon_port or free_port()
            if retrain and settings.registry is not None:
                _start_mlflow_ui(stack, settings.registry, mlflow_port or free_port(), data / "logs")
                _start_daemon(stack, settings, consent, engine_url, demo, daemon_port, data)
            if demo_key is not None:
                daemon_url = f"http://127.0.0.1:{daemon_port}" if retrain else None
                _start_demo_traffic(stack, engine_url, demo_key, consent.admin_token, data / "demo", daemon_url,
                                    demo_prompts, demo_prompts_file)
            run_server(settings)
        except _Stopped as stopped:
            log.info("%s: stopping server, sink and broker in order", stopped)
        finally:
            _handle_stop_signals(_already_stopping)


def _check_demo_prompts(source: DemoPrompts, prompts_file: Path | None) -> None:
    """Refuse a prompt set the demo traffic could not send, before anything starts."""
    from specloop.daemon.training.prompts import prompt_set

    try:
        prompts = prompt_set(source, prompts_file)
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("prompts_file: "), param_hint="'--demo-prompts-file'") from e
    if not prompts:
        raise typer.BadParameter("holds no prompts", param_hint="'--demo-prompts-file'")


def _demo_tenant(data_dir: Path) -> str:
    """A tenants file with the demo tenant (capture allowed) and anonymous access for everyone else,
    made the server's tenants file; the demo tenant's fresh API key."""
    key = secrets.token_urlsafe(24)
    path = data_dir / "demo" / "tenants.yaml"
    write_demo_tenants(path, key)
    os.environ["SPECLOOP_TENANTS_FILE"] = str(path)
    log.info("demo: tenant %r captures consented traffic (tenants file %s)", DEMO_TENANT, path)
    return key


def write_demo_tenants(path: Path, key: str) -> None:
    """The demo tenant, whose requests with `key` are consented and captured; anyone else anonymous."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_DEMO_TENANTS.format(key=key))


def _start_mlflow_ui(stack: ExitStack, registry: str, port: int, logs: Path) -> None:
    """MLflow's server over the registry's database, for its UI: versions, tags, aliases, runs."""
    command = [sys.executable, "-P", "-m", "mlflow", "server", "--backend-store-uri", registry,
               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    _child(stack, "MLflow UI", command, _log_file(stack, logs / "mlflow.log"))
    log.info("MLflow UI on http://127.0.0.1:%d (logs in %s)", port, logs / "mlflow.log")


def _start_daemon(stack: ExitStack, settings: "ServerSettings", consent: "ConsentConfig", engine_url: str,
                  demo: bool, port: int, data_dir: Path) -> None:
    policy = POLICIES / ("demo.yaml" if demo else "default.yaml")
    command = specloop_command("daemon", "--policy", str(policy), "--registry", settings.registry,
                               "--traces-root", str(consent.traces_root), "--consent-db", str(consent.registry_path),
                               "--state-db", f"sqlite:///{(data_dir / 'daemon' / 'state.db').resolve()}",
                               "--work-dir", str(data_dir / "daemon" / "runs"), "--engine", engine_url,
                               "--port", str(port), "--plot", str(data_dir / "daemon" / "live_tau.png"))
    if settings.model is not None:
        command += ["--model", settings.model]
    _child(stack, "retraining daemon", command, None, stop_s=_DAEMON_STOP_S)
    log.info("retraining daemon (policy %s) on http://127.0.0.1:%d; `specloop status` shows its runs", policy, port)


def _start_demo_traffic(stack: ExitStack, engine_url: str, key: str, admin_token: str, out: Path,
                        daemon_url: str | None, prompts: DemoPrompts, prompts_file: Path | None) -> None:
    """`specloop replay` of the demo's prompts, over and over, as consented users of the demo tenant;
    paused while the daemon trains, which on 2 cores would otherwise run at half speed."""
    out.mkdir(parents=True, exist_ok=True)
    source = ["--source", prompts] + (["--prompts-file", str(prompts_file.resolve())] if prompts_file else [])
    command = specloop_command("replay", "--url", engine_url, *source, "--api-key", key, "--tenant",
                               DEMO_TENANT, "--users", "8", "--concurrency", str(_DEMO_CONCURRENCY), "--max-tokens",
                               "192", "--repeat", "--record", str(out / "traffic.jsonl"), "--dead-after-s",
                               str(_DEMO_WAIT_S))
    if daemon_url is not None:
        command += ["--pause-while-training", daemon_url]
    _child(stack, "demo traffic", command, None, env={**os.environ, "SPECLOOP_ADMIN_TOKEN": admin_token})


def _child(stack: ExitStack, name: str, command: list[str], output: IO[bytes] | None, stop_s: float = 30.0,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child in its own session (Ctrl-C reaches only us), stopped with SIGTERM when the stack unwinds."""
    child = subprocess.Popen(command, stdout=output, stderr=output, env=env, start_new_session=True,
                             preexec_fn=die_with_parent())
    stack.callback(_stop_child, name, child, stop_s)
    log.info("%s: pid %d", name, child.pid)
    return child


def _stop_child(name: str, child: subprocess.Popen, stop_s: float) -> None:
    child.terminate()
    try:
        child.wait(stop_s)
    except subprocess.TimeoutExpired:
        log.error("%s did not stop within %.0f s; killing it", name, stop_s)
        child.kill()
        child.wait()


def _embedded_registry(data_dir: Path) -> str:
    """The embedded MLflow registry's URI, seeded with the shipped drafters."""
    from specloop.daemon.shipped_drafters import seed_registry
    from specloop.storage.registry import DrafterRegistry

    directory = data_dir / "registry"
    directory.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{(directory / 'mlflow.db').resolve()}"
    seed_registry(DrafterRegistry(uri, directory / "artifacts"))
    return uri


def _handle_stop_signals(handler: Callable[[int, FrameType | None], None]) -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, handler)


def _raise_stopped(number: int, _: FrameType | None) -> None:
    raise _Stopped(signal.Signals(number).name)


def _already_stopping(number: int, _: FrameType | None) -> None:
    log.warning("%s ignored: already stopping (the sink may take up to %d s to flush)",
                signal.Signals(number).name, _SINK_STOP_S)


def _start_broker(stack: ExitStack, durable: bool, port: int, topic: str, logs: Path) -> None:
    from specloop.storage.broker import EmbeddedBroker, LocalS3, ensure_topics

    logs.mkdir(parents=True, exist_ok=True)
    with sigint_blocked():
        s3 = stack.enter_context(LocalS3(log=_log_file(stack, logs / "moto.log"))) if durable else None
        broker = stack.enter_context(EmbeddedBroker(s3=s3, port=port, log=_log_file(stack, logs / "tansu.log")))
    ensure_topics(broker.bootstrap_servers, {topic: TRACE_PARTITIONS, DEAD_LETTER_TOPIC: 1})
    log.info("tansu (%s storage) on %s, logs in %s", broker.storage, broker.bootstrap_servers, logs)


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Processes started inside inherit a blocked SIGINT; this process's mask is restored after."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _log_file(stack: ExitStack, path: Path) -> IO[bytes]:
    return stack.enter_context(open(path, "ab"))


def _start_sink(stack: ExitStack, bootstrap: str, topic: str, root: Path) -> None:
    """The sink process, once its consumer group is stable, so that it reads traces as they arrive.

    Serving before that would let a quick start-and-stop end with traces on the broker that the
    sink never read, which memory storage then loses.
    """
    command = specloop_command("sink", "--bootstrap-servers", bootstrap, "--root", str(root), "--topic", topic,
                               "--group-id", SINK_GROUP, "--dead-letter-topic", DEAD_LETTER_TOPIC,
                               "--flush-interval-s", str(_SINK_FLUSH_S))
    sink = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent())
    stack.callback(_stop_sink, sink)
    log.info("sink (pid %d) writing Parquet under %s", sink.pid, root)
    wait_for_group(bootstrap, [sink])


def wait_for_group(bootstrap: str, sinks: list[subprocess.Popen]) -> None:
    """Until the sinks' consumer group is stable; raises if a sink exits first."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    # tansu describes the group's state but lists no members, so STABLE is the signal: the members
    # that joined have been given the partitions (with several sinks, all that joined by then).
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + _SINK_READY_S
    while admin.describe_consumer_groups([SINK_GROUP])[SINK_GROUP].result(5).state != ConsumerGroupState.STABLE:
        if (sink := next((s for s in sinks if s.poll() is not None), None)) is not None:
            raise RuntimeError(f"the sink exited with status {sink.returncode} before joining its group")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sink did not join consumer group {SINK_GROUP} within {_SINK_READY_S} s")
        time.sleep(0.2)


def _stop_sink(sink: subprocess.Popen) -> None:
    """SIGTERM makes the sink flush and commit; it is killed only if that hangs."""
    time.sleep(_SINK_CATCH_UP_S)
    sink.terminate()
    try:
        code = sink.wait(_SINK_STOP_S)
    except subprocess.TimeoutExpired:
        log.error("sink did not stop within %d s; killing it (uncommitted traces are re-read next time)",
                  _SINK_STOP_S)
        sink.kill()
        code = sink.wait()
    log.info("sink exited with status %d", code)

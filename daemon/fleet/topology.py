"""`Fleet`: the production topology as processes on one machine, what `specloop fleet` runs.

One Postgres server (`postgres.py`) holds the daemons' shared state database (lease, run log,
history, job store, live τ) and MLflow's backend store. Around it: the embedded tansu broker with
the trace topics, `mlflow server` with its basic-auth app exactly as deploy/ runs it
(`deploy/mlflow-auth.ini`, the daemons write as its admin, the engines read as `engine`), N engines
(`specloop serve`) following the `champion` alias, N sinks in one consumer group and N daemons
contending for the base model's lease. Every process is started with the command, options and
`SPECLOOP_*` variables that deploy/'s files use (tests/test_deploy.py holds both to the CLI), so
what runs here is what they describe; what differs is only where the data lives (`root`).

Each process is a `Service`, named `engine-1`, `sink-2`, `daemon-1`, `mlflow`, ... Faults are
made by name: `kill("engine-1")` (SIGKILL), then `start("engine-1")` again; `postgres.restart()`;
`stop("mlflow")`. Shutdown runs in dependency order: daemons (they abandon a run), traffic, engines
(they drain and flush capture), sinks (they write and commit), MLflow, the broker, Postgres.

Not here: the command line (`cli.py`), serving, sinking or retraining themselves.
"""

import json
import logging
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from specloop.consent.settings import load_or_create_secrets
from specloop.daemon.child_command import specloop_command
from specloop.daemon.fleet.postgres import SharedPostgres
from specloop.daemon.stack import (
    DEAD_LETTER_TOPIC,
    POLICIES,
    SINK_GROUP,
    TRACE_PARTITIONS,
    sigint_blocked,
    wait_for_group,
    write_demo_tenants,
)
from specloop.storage.broker import EmbeddedBroker, ensure_topics, free_port
from specloop.storage.child_process import die_with_parent

log = logging.getLogger(__name__)

CHECKOUT = Path(__file__).resolve().parents[2]
MLFLOW_AUTH_CONFIG = CHECKOUT / "deploy" / "mlflow-auth.ini"
ENGINE_USER = "engine"
ADMIN_USER = "admin"  # mlflow-auth.ini's admin_username
_READY_S = {"engine": 600.0, "mlflow": 120.0, "daemon": 300.0, "sink": 60.0}  # an engine's first start compiles kernels
# SIGTERM budgets, as deploy/compose.yaml's stop_grace_period: a daemon abandons its run, an engine
# drains requests (30 s) and flushes capture (10 s), a sink writes and commits its batch.
_STOP_S = {"daemon": 90.0, "traffic": 30.0, "engine": 45.0, "sink": 60.0, "mlflow": 30.0}
_SINK_CATCH_UP_S = 2.0  # the engines' last traces reach the broker; the sinks read them before SIGTERM


@dataclass(frozen=True)
class FleetConfig:
    """Where the fleet keeps its data, how many of each process, and their ports (0: a free one)."""

    root: Path
    engines: int = 2
    sinks: int = 2
    daemons: int = 2
    model: str | None = None  # None: the SmolLM2 GGUF, as `specloop serve`
    served_model_name: str | None = None  # None: the model's own name
    policy: Path = POLICIES / "default.yaml"
    engine_port: int = 8000  # engine i listens on engine_port + i - 1
    daemon_port: int = 8100
    mlflow_port: int = 5000
    registry_poll_s: float = 30.0
    sink_flush_s: float = 30.0  # the sink's own default, as deploy/ runs it
    env: dict[str, str] = field(default_factory=dict)  # extra variables for every specloop process

    def __post_init__(self) -> None:
        for name in ("engines", "sinks", "daemons"):
            if not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"{name} must be between 1 and 8, got {getattr(self, name)}")
        if self.sinks > TRACE_PARTITIONS:
            raise ValueError(f"sinks must be at most the trace topic's {TRACE_PARTITIONS} partitions, "
                             f"got {self.sinks} (a sink beyond them would hold none)")
        for name in ("engine_port", "daemon_port", "mlflow_port"):
            last = getattr(self, name) + (self.engines if name == "engine_port" else self.daemons) - 1
            if not 0 <= getattr(self, name) or last > 65535:
                raise ValueError(f"{name} must leave every process a port in 1-65535 (0: free ones), got "
                                 f"{getattr(self, name)}")
        if not self.policy.is_file():
            raise ValueError(f"policy: no such file {self.policy}")


@dataclass
class Service:
    """One long-lived process of the fleet: how to start it, and the process while it runs."""

    name: str
    command: list[str]
    env: dict[str, str]
    log: Path
    ready_url: str | None  # answers 200 once the process serves
    cwd: Path | None = None
    process: subprocess.Popen | None = None

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Fleet:
    """`with Fleet(config) as fleet:` runs the whole topology until the block ends."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.root = config.root.resolve()
        self.postgres = SharedPostgres(self.root / "postgres")
        self.broker: EmbeddedBroker | None = None
        self.services: dict[str, Service] = {}
        self._logs: list[IO[bytes]] = []
        self._secrets: dict[str, str] = {}
        self._consent_secrets: dict[str, str] = {}

    # ---------------------------------------------------------------- the topology

    @property
    def mlflow_url(self) -> str:
        return self.services["mlflow"].ready_url.removesuffix("/health")

    @property
    def engine_urls(self) -> list[str]:
        return [s.ready_url.removesuffix("/ready") for s in self._of("engine")]

    @property
    def daemon_urls(self) -> list[str]:
        return [s.ready_url.removesuffix("/health") for s in self._of("daemon")]

    @property
    def tenants_file(self) -> Path:
        return self.root / "tenants.yaml"

    @property
    def traces_root(self) -> Path:
        return self.root / "traces"

    @property
    def api_key(self) -> str:
        """The fleet tenant's key: its requests are consented traffic, captured."""
        return self._secrets["tenant_key"]

    @property
    def admin_token(self) -> str:
        """The consent admin API's token, shared by every engine (it grants the tenant's consents)."""
        return self._consent_secrets["admin_token"]

    @property
    def admin_env(self) -> dict[str, str]:
        """MLflow credentials of the registry's writer (what the daemons log in as)."""
        return {"MLFLOW_TRACKING_USERNAME": ADMIN_USER, "MLFLOW_TRACKING_PASSWORD": self._secrets["admin_password"]}

    def __enter__(self) -> "Fleet":
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _start_all(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self._secrets = _fleet_secrets(self.root / "fleet-secrets.json")
        write_demo_tenants(self.tenants_file, self.api_key)
        self._consent_secrets = load_or_create_secrets(self.root / "consent")  # before engines race to make them
        with sigint_blocked():  # Ctrl-C in a terminal reaches these two otherwise: they are not in their own session
            self.postgres.start()
            self.broker = EmbeddedBroker(log=self._log_file(self.root / "logs" / "tansu.log")).start()
        ensure_topics(self.broker.bootstrap_servers, {"traces": TRACE_PARTITIONS, DEAD_LETTER_TOPIC: 1})
        self._define_services()
        self.start("mlflow")
        self._add_engine_user()
        self._seed_registry()
        for service in self._of("engine"):
            self._launch(service)
        for service in self._of("engine"):
            self._wait_ready(service)
        for service in self._of("sink"):
            self._launch(service)
        wait_for_group(self.broker.bootstrap_servers, [s.process for s in self._of("sink")])
        for service in self._of("daemon"):
            self._launch(service)
        for service in self._of("daemon"):
            self._wait_ready(service)
        log.info("fleet: up under %s: engines %s, daemons %s, MLflow %s", self.root, " ".join(self.engine_urls),
                 " ".join(self.daemon_urls), self.mlflow_url)

    def _define_services(self) -> None:
        c, logs = self.config, self.root / "logs"
        consent = {"SPECLOOP_DATA_DIR": str(self.root / "consent"), "SPECLOOP_TRACES_ROOT": str(self.traces_root),
                   "SPECLOOP_CONSENT_DB": str(self.root / "consent" / "consent.db"),
                   "SPECLOOP_TENANTS_FILE": str(self.tenants_file)}
        if c.model is not None:
            consent["SPECLOOP_MODEL"] = c.model
        if c.served_model_name is not None:
            consent["SPECLOOP_SERVED_MODEL_NAME"] = c.served_model_name
        base = {**os.environ, **c.env, **consent}
        mlflow_port = c.mlflow_port or free_port()
        registry = f"http://127.0.0.1:{mlflow_port}"
        self._add(Service("mlflow", _mlflow_command(self.postgres.url("mlflow"), self.root / "mlflow" / "artifacts",
                                                    mlflow_port),
                          {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(MLFLOW_AUTH_CONFIG),
                           "MLFLOW_AUTH_ADMIN_PASSWORD": self._secrets["admin_password"],
                           "MLFLOW_FLASK_SERVER_SECRET_KEY": self._secrets["flask_secret"]},
                          logs / "mlflow.log", f"{registry}/health", cwd=self.root / "mlflow"))
        reader = {"MLFLOW_TRACKING_USERNAME": ENGINE_USER, "MLFLOW_TRACKING_PASSWORD": self._secrets["engine_password"]}
        for i in range(1, c.engines + 1):
            port = c.engine_port + i - 1 if c.engine_port else free_port()
            env = {**base, **reader, "SPECLOOP_REGISTRY": registry, "SPECLOOP_HOST": "127.0.0.1",
                   "SPECLOOP_PORT": str(port), "SPECLOOP_KAFKA_BOOTSTRAP": self.broker.bootstrap_servers,
                   "SPECLOOP_REGISTRY_POLL_S": str(c.registry_poll_s),
                   "SPECLOOP_DRAFTER_CACHE_DIR": str(self.root / f"engine-{i}" / "drafters")}
            self._add(Service(f"engine-{i}", specloop_command("serve"), env, logs / f"engine-{i}.log",
                              f"http://127.0.0.1:{port}/ready"))
        for i in range(1, c.sinks + 1):
            metrics = free_port()
            command = specloop_command("sink", "--bootstrap-servers", self.broker.bootstrap_servers, "--root",
                                       str(self.traces_root), "--group-id", SINK_GROUP, "--dead-letter-topic",
                                       DEAD_LETTER_TOPIC, "--flush-interval-s", str(c.sink_flush_s),
                                       "--metrics-port", str(metrics))
            self._add(Service(f"sink-{i}", command, base, logs / f"sink-{i}.log", f"http://127.0.0.1:{metrics}/metrics"))
        engines = [arg for url in self.engine_urls for arg in ("--engine", url)]
        for i in range(1, c.daemons + 1):
            port = c.daemon_port + i - 1 if c.daemon_port else free_port()
            command = specloop_command("daemon", "--policy", str(c.policy), "--state-db",
                                       self.postgres.url("specloop_state"), "--work-dir",
                                       str(self.root / "daemon" / "runs"), *engines, "--host", "127.0.0.1",
                                       "--port", str(port))
            env = {**base, **self.admin_env, "SPECLOOP_REGISTRY": registry}
            self._add(Service(f"daemon-{i}", command, env, logs / f"daemon-{i}.log", f"http://127.0.0.1:{port}/health"))

    def _add(self, service: Service) -> None:
        self.services[service.name] = service

    def _of(self, kind: str) -> list[Service]:
        return [s for s in self.services.values() if s.kind == kind]

    def _add_engine_user(self) -> None:
        """The engines' read-only registry user, as deploy/'s one-shot makes it (created, or its password set)."""
        env = {**os.environ, **self.admin_env, "SPECLOOP_REGISTRY": self.mlflow_url,
               "SPECLOOP_REGISTRY_READER_PASSWORD": self._secrets["engine_password"]}
        run = subprocess.run(specloop_command("registry", "add-reader", "--username", ENGINE_USER), env=env,
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"specloop registry add-reader failed: {run.stderr[-2000:]}")

    def _seed_registry(self) -> None:
        """The shipped drafters, each champion of its base model while MLflow holds no version of it,
        written as the registry's admin (the children get their credentials explicitly)."""
        from specloop.daemon.shipped_drafters import seed_registry
        from specloop.storage.registry import DrafterRegistry, mlflow_environment

        with mlflow_environment(self.admin_env):
            seed_registry(DrafterRegistry(self.mlflow_url))

    # ---------------------------------------------------------------- one process at a time

    def start(self, name: str) -> None:
        """Start `name` (again) and wait until it serves."""
        service = self.services[name]
        self._launch(service)
        if service.kind == "sink":
            wait_for_group(self.broker.bootstrap_servers, [service.process])
        else:
            self._wait_ready(service)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send `sig` to `name` and wait for it to exit."""
        service = self.services[name]
        assert service.running, f"{name} is not running"
        service.process.send_signal(sig)
        service.process.wait(_STOP_S.get(service.kind, 30.0) + 30)

    def stop(self, name: str) -> None:
        """SIGTERM, as a service manager stops it; SIGKILL if it outlives its budget."""
        service = self.services[name]
        if not service.running:
            return
        service.process.terminate()
        try:
            service.process.wait(_STOP_S.get(service.kind, 30.0))
        except subprocess.TimeoutExpired:
            log.error("%s did not stop within %.0f s; killing it", name, _STOP_S.get(service.kind, 30.0))
            service.process.kill()
            service.process.wait()

    def close(self) -> None:
        for kind in ("daemon", "traffic", "engine"):
            for service in self._of(kind):
                self.stop(service.name)
        if any(s.running for s in self._of("sink")):
            time.sleep(_SINK_CATCH_UP_S)
        for kind in ("sink", "mlflow"):
            for service in self._of(kind):
                self.stop(service.name)
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        self.postgres.stop()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def _launch(self, service: Service) -> None:
        assert not service.running, f"{service.name} is already running"
        if service.cwd is not None:
            service.cwd.mkdir(parents=True, exist_ok=True)
        output = self._log_file(service.log)
        service.process = subprocess.Popen(service.command, env=service.env, cwd=service.cwd, stdout=output,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=die_with_parent())
        log.info("fleet: %s started (pid %d, log %s)", service.name, service.process.pid, service.log)

    def _wait_ready(self, service: Service) -> None:
        deadline = time.monotonic() + _READY_S[service.kind]
        while not _answers(service.ready_url):
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.name} exited with status {service.process.returncode} before it "
                                   f"was ready:\n{_tail(service.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service.name} was not ready within {_READY_S[service.kind]:.0f} s:\n"
                                   f"{_tail(service.log)}")
            time.sleep(0.3)

    def _log_file(self, path: Path) -> IO[bytes]:
        f = open(path, "ab")
        self._logs.append(f)
        return f

    def add_traffic(self, name: str, command: list[str], env: dict[str, str]) -> Service:
        """A client process stopped before the engines (the demo's replay); it is not waited for."""
        service = Service(f"traffic-{name}", command, env, self.root / "logs" / f"traffic-{name}.log", None)
        self._add(service)
        self._launch(service)
        return service


def _mlflow_command(backend: str, artifacts: Path, port: int) -> list[str]:
    """`mlflow server` as deploy/ runs it: the basic-auth app, artifacts served by the server."""
    import sys

    return [sys.executable, "-P", "-m", "mlflow", "server", "--app-name", "basic-auth", "--backend-store-uri",
            backend, "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
            "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}", "--workers", "1"]


def _fleet_secrets(path: Path) -> dict[str, str]:
    """The fleet's generated passwords and keys, kept (mode 600) so a restarted fleet logs in again:
    MLflow keeps the admin password it was first started with."""
    if path.exists():
        return json.loads(path.read_text())
    fresh = {"admin_password": secrets.token_hex(24), "engine_password": secrets.token_hex(24),
             "flask_secret": secrets.token_hex(32), "tenant_key": secrets.token_urlsafe(24)}
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as f:
        json.dump(fresh, f)
    return fresh


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def wait_until(check: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5) -> object:
    """Poll `check` until it returns something truthy; that value. TimeoutError names `what`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return value

"""The production topology on one machine (`specloop fleet`), broken on purpose: one shared Postgres,
an MLflow server with its basic-auth app, two engines, two sinks and two daemons as real processes,
serving the tiny random Llama (the topology, not the model, is under test; `benchmarks/fleet_faults.py`
runs it on SmolLM2). Each test kills or restarts a part and checks the contract the others keep.

The tests share one fleet and run in file order: each leaves it whole again.
"""

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import httpx
import pytest
from sqlalchemy import text

from specloop.consent.settings import ConsentSettings
from specloop.daemon.fleet.topology import Fleet, FleetConfig, wait_until
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.stack import DEMO_TENANT
from specloop.engine.server.settings import ServerSettings
from tests.test_deploy import (
    DAEMON_VARIABLES,
    SPECLOOP,
    SYSTEMD,
    argv,
    compose,
    compose_argv,
    compose_env,
    declared_envvars,
    env_example,
    exec_start,
    the_container,
    unit_environment,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LEASE_TTL_S = 3
POLL_S = 30.0  # the engines' default: a promotion reaches them sooner by the daemon's notice
NOTICE_S = 10.0  # how soon that is, a download and a swap included
# Trains for 12 s per run, so that a daemon can be killed in training; any challenger is promoted.
# The held-out split hashes each trace's id, so 40 requests hold out 10 on average, binomially: with
# min_heldout 4 a fleet that held out 3 (P = 0.5%) skipped every run and the first test waited in
# vain, as it did once here; with 2 that is P = 0.014%.
POLICY = """
schedule: {interval_minutes: 0.05}
triggers: {min_new_traces: 10, first_drafter: false}
data: {min_traces: 10, first_drafter_prompts: 0}
training: {max_steps: 100000, max_minutes: 0.2, batch_size: 2, anchors: 8, block_size: 4}
evaluation: {heldout_fraction: 0.25, min_heldout: 2}
gate: {min_relative_gain: -1.0}
cooldown_minutes: 0
"""
USERS = [f"user-{i}" for i in range(4)]
MODEL = "tiny-llama-deep"


@pytest.fixture(scope="module")
def fleet(tiny_hf_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    policy = root / "policy.yaml"
    policy.write_text(POLICY)
    config = FleetConfig(root / "fleet", model=str(tiny_hf_model("llama-deep")), served_model_name=MODEL,
                         policy=policy, engine_port=0, daemon_port=0, mlflow_port=0, registry_poll_s=POLL_S,
                         sink_flush_s=1.0,
                         env={"SPECLOOP_DAEMON_LEASE_TTL_S": str(LEASE_TTL_S), "SPECLOOP_DAEMON_WATCH_S": "2",
                              "SPECLOOP_MAX_LEN": "256"})
    with Fleet(config) as running:
        admin = {"Authorization": f"Bearer {running.admin_token}"}
        for user in USERS:
            r = httpx.post(f"{running.engine_urls[0]}/admin/consents", headers=admin, timeout=30,
                           json={"tenant": DEMO_TENANT, "user": user, "source": "test"})
            assert r.status_code in (200, 201), r.text
        yield running


def chat(url: str, key: str | None, user: str, max_tokens: int = 16, stream: bool = False) -> str:
    """One request, consented with the tenant's key, anonymous (never captured) without; its id,
    which is its trace's id."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {uuid.uuid4().hex[:8]}"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "user": user, "stream": stream}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["id"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[0].removeprefix("data: "))["id"]


def served_version(url: str) -> str | None:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["drafter_version"]


def runs(fleet: Fleet) -> RunLog:
    return RunLog(open_state(fleet.postgres.url("specloop_state")))


def lease_holder_pid(fleet: Fleet) -> int | None:
    with open_state(fleet.postgres.url("specloop_state")).connect() as conn:
        row = conn.execute(text("SELECT owner FROM leases WHERE name LIKE 'train:%' AND expires_at > :now"),
                           {"now": time.time()}).first()
    return None if row is None else int(row.owner.split(":")[1])


def stored_trace_ids(fleet: Fleet) -> list[str]:
    files = list(fleet.traces_root.rglob("*.parquet"))
    if not files:
        return []
    return [r[0] for r in duckdb.sql(f"SELECT trace_id FROM read_parquet({[str(f) for f in files]!r})").fetchall()]


def send(fleet: Fleet, count: int) -> list[str]:
    return [chat(fleet.engine_urls[i % 2], fleet.api_key, USERS[i % len(USERS)]) for i in range(count)]


def test_sigkill_the_lease_holder_in_training_then_a_promotion_reaches_both_engines(fleet: Fleet) -> None:
    """The other daemon takes the lease over within its TTL, records the killed run as abandoned,
    and its own run promotes a fully registered version that both engines serve at once (the
    daemon tells them: well within their poll)."""
    log = runs(fleet)
    send(fleet, 40)
    training = wait_until(lambda: next((r for r in log.runs() if r.step == "train" and r.outcome is RunOutcome.RUNNING),
                                       None), 120, "a run in training")
    holder = lease_holder_pid(fleet)
    (name,) = [n for n, s in fleet.services.items() if s.kind == "daemon" and s.process.pid == holder]
    fleet.kill(name)
    killed_at = time.monotonic()
    try:
        taken = wait_until(lambda: (pid := lease_holder_pid(fleet)) not in (None, holder) and pid, 60,
                           "the lease taken")
        took_s = time.monotonic() - killed_at
        wait_until(lambda: any(r.outcome is RunOutcome.PROMOTED for r in log.runs()), 120, "a promotion")
        (killed,) = [r for r in log.runs() if r.run_id == training.run_id]
        assert killed.outcome is RunOutcome.ABANDONED and "at step train" in killed.detail
        assert killed.version is None  # nothing half-registered
        assert taken != holder and took_s < LEASE_TTL_S + 10  # the TTL, then the next tick (every 3 s)
        wait_until(lambda: newest_served_by_both(fleet, log), NOTICE_S, "both engines serving the promoted version")
    finally:
        fleet.start(name)  # whatever failed above, the next tests get a whole fleet


def newest_served_by_both(fleet: Fleet, log: RunLog) -> bool:
    """Whether both engines serve the newest promoted version (a later run may promote meanwhile)."""
    newest = [r for r in log.runs() if r.outcome is RunOutcome.PROMOTED][-1]
    return all(served_version(u) == f"v{newest.version}" for u in fleet.engine_urls)


class Load:
    """`clients` threads sending streamed chats to `urls` in turn until the block ends; `failures`.
    Anonymous, so that it adds no traces and starts no run."""

    def __init__(self, fleet: Fleet, urls: list[str], clients: int = 3) -> None:
        self.fleet, self.urls = fleet, urls
        self.done: list[str] = []
        self.failures: list[Exception] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,)) for i in range(clients)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        wait_until(lambda: len(self.done) + len(self.failures) >= len(self._threads), 60, "the load started")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _send(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                self.done.append(chat(self.urls[i % len(self.urls)], None, "anyone", max_tokens=48, stream=True))
            except Exception as e:  # noqa: BLE001 (the tests assert there are none)
                self.failures.append(e)
            i += 1


def test_sigkill_one_engine_under_streaming_load(fleet: Fleet) -> None:
    """Streams on the surviving engine all finish; the restarted engine serves the current champion
    within a poll of being ready."""
    survivor, victim = fleet.engine_urls
    champion = served_version(survivor)
    with Load(fleet, [survivor]) as load:
        fleet.kill("engine-2")
        time.sleep(3)
    assert load.done and load.failures == []
    fleet.start("engine-2")  # ready before its drafter: it drafts with suffix decoding alone until its first poll
    wait_until(lambda: served_version(victim) == champion, POLL_S + 30, "the restarted engine serving the champion")


def test_sigkill_one_sink_mid_flush_loses_and_duplicates_nothing(fleet: Fleet) -> None:
    """Traces written while a sink is killed land in Parquet exactly once, by trace id."""
    sent = send(fleet, 20)
    fleet.kill("sink-1")
    sent += send(fleet, 20)
    wait_until(lambda: set(sent) <= set(stored_trace_ids(fleet)), 120, "every trace in Parquet")
    fleet.start("sink-1")
    sent += send(fleet, 10)
    wait_until(lambda: set(sent) <= set(stored_trace_ids(fleet)), 60, "every trace in Parquet")
    stored = stored_trace_ids(fleet)
    assert len(stored) == len(set(stored))  # nothing twice, across every trace the fleet stored


def _ticks(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("specloop_daemon_ticks_total"))


def test_postgres_restarts_while_daemons_tick_and_engines_poll(fleet: Fleet) -> None:
    """Nothing restarts but Postgres: requests succeed throughout, and both daemons tick again after."""
    with Load(fleet, fleet.engine_urls) as load:
        before = [_ticks(u) for u in fleet.daemon_urls]
        fleet.postgres.restart()
        wait_until(lambda: all(_ticks(u) > b for u, b in zip(fleet.daemon_urls, before)), 120,
                   "both daemons ticking again")
    assert load.done and load.failures == []
    assert all(s.running for s in fleet.services.values())


def test_mlflow_down_engines_serve_and_a_run_fails_cleanly(fleet: Fleet) -> None:
    """With MLflow stopped the engines keep the drafter each serves and every request succeeds; a run in
    flight fails and is recorded; once MLflow is back the next run promotes."""
    log = runs(fleet)
    before = {r.run_id for r in log.runs()}
    promoted = sum(r.outcome is RunOutcome.PROMOTED for r in log.runs())
    send(fleet, 40)
    training = wait_until(lambda: next((r for r in log.runs() if r.run_id not in before and r.step == "train"
                                        and r.outcome is RunOutcome.RUNNING), None), 120, "a new run in training")
    fleet.stop("mlflow")
    serving = [served_version(u) for u in fleet.engine_urls]  # nothing can move them now
    try:
        failed = wait_until(lambda: next((r for r in log.runs() if r.run_id == training.run_id
                                          and r.outcome is RunOutcome.FAILED), None), 120, "the run failed")
        assert "MLflow" in failed.detail or "registry" in failed.detail.lower(), failed.detail
        with Load(fleet, fleet.engine_urls) as load:
            time.sleep(3)
        assert load.done and load.failures == []
        assert [served_version(u) for u in fleet.engine_urls] == serving and None not in serving
    finally:
        fleet.start("mlflow")
    send(fleet, 40)
    wait_until(lambda: sum(r.outcome is RunOutcome.PROMOTED for r in log.runs()) > promoted, 180,
               "a promotion after MLflow came back")
    wait_until(lambda: newest_served_by_both(fleet, log), NOTICE_S, "both engines serving it")


def options(command: list[str]) -> set[str]:
    return {arg.partition("=")[0] for arg in command if arg.startswith("--")}


# The variables each kind of process reads, so that a unit's shared env file is held to the ones it uses.
READS = {"mlflow": {"MLFLOW_AUTH_CONFIG_PATH"},
         "engine": {f"SPECLOOP_{n.upper()}" for n in (*ServerSettings.model_fields, *ConsentSettings.model_fields)},
         "sink": set(declared_envvars(SPECLOOP.commands["sink"])),
         "daemon": DAEMON_VARIABLES | {"SPECLOOP_DATA_DIR", "SPECLOOP_ADMIN_TOKEN"}}  # the engines' admin token
# What the units set for systemd's sake, not the topology's: a log level, and a writable cache
# directory under ProtectSystem=strict.
NOT_TOPOLOGY = {"SPECLOOP_LOG_LEVEL", "XDG_CACHE_HOME"}


def option_for(kind: str, variable: str) -> str | None:
    """The option of `kind`'s command that sets what `variable` sets, if it has one."""
    if kind == "sink":
        return next((p.opts[0] for p in SPECLOOP.commands["sink"].params if p.envvar == variable), None)
    if kind == "daemon":
        field = next((n for n, f in DaemonSettings.model_fields.items() if variable in f.validation_alias.choices),
                     None)
        return None if field is None else "--engine" if field == "engines" else f"--{field.replace('_', '-')}"
    return None


@pytest.mark.parametrize("kind", ["mlflow", "engine", "sink", "daemon"])
def test_the_deploy_files_run_what_the_fleet_ran(fleet: Fleet, kind: str) -> None:
    """Every option deploy/compose.yaml, the Kubernetes manifests and the systemd units give each
    long-lived process, and every variable Compose and the units set for it, is one the fleet's
    process of that kind ran with (as a variable or its option): what passed above is what those
    files start."""
    ran = fleet.services[kind if kind == "mlflow" else f"{kind}-1"]
    service = compose()["services"][kind]
    assert options(compose_argv(service)) <= options(ran.command)
    assert set(compose_env(service)) <= set(ran.env)
    assert options(argv(the_container(f"specloop-{kind}"))) <= options(ran.command)
    unit = SYSTEMD / f"specloop-{kind}.service"
    assert options(exec_start(unit)) <= options(ran.command)
    given = {**(env_example() if kind != "mlflow" else {}), **unit_environment(unit)}
    for variable in set(given) & READS[kind] - NOT_TOPOLOGY:
        assert variable in ran.env or option_for(kind, variable) in options(ran.command), variable
    assert set(unit_environment(unit)) - NOT_TOPOLOGY <= READS[kind]  # nothing a unit sets goes unread

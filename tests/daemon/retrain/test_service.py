"""The daemon as a service on the tiny model: its tick job persists across restarts (a missed tick
runs on restart, coalesced), a tick trains only when a trigger fires, and the HTTP side reports
health, metrics and status."""

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore

from specloop.daemon.retrain.http import daemon_app
from specloop.daemon.retrain.run import Loop
from specloop.daemon.retrain.run_log import RunOutcome
from specloop.daemon.retrain.service import RETRY_TICK_S, RetrainDaemon, _survive, scheduled_tick
from specloop.daemon.retrain.status import next_tick, tick_job_id
from specloop.storage.registry import DrafterRegistry, RegistryUnavailable
from tests.daemon.retrain.conftest import FAST_POLICY, first_drafter_policy, seed_champion, short_prompts, store_traces
from tests.server_thread import serve_in_thread

pytestmark = pytest.mark.timeout(300)

HOURLY = FAST_POLICY.replace("schedule: {interval_minutes: 1}", "schedule: {interval_minutes: 60}")


def daemon_of(loop: Loop) -> RetrainDaemon:
    return RetrainDaemon(loop.settings.model_copy(update={"watch_s": 0.5}), loop.policy, loop.target, loop.registry)


def wait_for(check: Callable[[], object], timeout: float = 120.0, why: Callable[[], str] = lambda: "timed out"
             ) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, why()
        time.sleep(0.2)
    return value


def test_the_tick_job_survives_a_restart_and_a_missed_tick_runs_once(make_loop: Callable[..., Loop],
                                                                     consent_id: str) -> None:
    loop = make_loop(HOURLY)
    daemon = daemon_of(loop)
    daemon.start()
    due = daemon.next_tick()
    assert due is not None and due > datetime.now(UTC) + timedelta(minutes=59)
    daemon.shutdown()
    assert next_tick(daemon.db, loop.base_model) == due  # persisted in the state database
    # As if the daemon had been down since 30 s before the tick fell due (within the misfire
    # grace): the stored job's next run time is in the past.
    late = datetime.now(UTC) - timedelta(seconds=30)
    store = SQLAlchemyJobStore(engine=daemon.db)
    store.start(daemon.scheduler, "default")
    job = store.lookup_job(tick_job_id(loop.base_model))
    job._modify(next_run_time=late)
    store.update_job(job)
    store_traces(loop.settings.traces_root, loop.target, consent_id, 40)
    restarted = daemon_of(make_loop(HOURLY))
    restarted.start()
    try:
        report = wait_for(lambda: restarted.last_tick)
        assert report.decision.train and report.run_id is not None
        assert restarted.next_tick() > datetime.now(UTC) + timedelta(minutes=58)  # rescheduled, not run again
        runs = restarted.loop.runs.runs()
        assert len(runs) == 1 and runs[0].outcome in (RunOutcome.PROMOTED, RunOutcome.REFUSED), runs[0].detail
    finally:
        restarted.shutdown()


def test_a_base_model_without_a_drafter_gets_its_first_from_the_first_start(make_loop: Callable[..., Loop],
                                                                             tmp_path: Path) -> None:
    # Hourly ticks, no traces of any model, nothing registered: the first tick comes at once.
    policy = first_drafter_policy(short_prompts(tmp_path / "prompts.jsonl")).replace(
        "schedule: {interval_minutes: 1}", "schedule: {interval_minutes: 60}")
    loop = make_loop(policy)
    daemon = daemon_of(loop)
    daemon.start()
    try:
        report = wait_for(lambda: daemon.last_tick)
        assert report.decision.reason == "no drafter registered for this base model: training its first"
        (run,) = loop.runs.runs()
        assert run.outcome is RunOutcome.PROMOTED, run.detail
        assert loop.registry.champion(loop.base_model).version == "1"
        assert daemon.next_tick() > datetime.now(UTC) + timedelta(minutes=58)  # then back on the schedule
    finally:
        daemon.shutdown()
    restarted = daemon_of(make_loop(policy))  # a drafter is registered now: no early tick
    restarted.start()
    try:
        assert restarted.next_tick() > datetime.now(UTC) + timedelta(minutes=58)
    finally:
        restarted.shutdown()


def test_shutdown_during_a_scheduled_run_abandons_it_and_returns(make_loop: Callable[..., Loop],
                                                                  consent_id: str) -> None:
    # A run that would train for minutes; the tick job is made due now, so the scheduler runs it.
    loop = make_loop(HOURLY.replace("max_steps: 12,", "max_steps: 100000,"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 40)
    daemon = daemon_of(loop)
    daemon.start()
    daemon.scheduler.modify_job(tick_job_id(loop.base_model), next_run_time=datetime.now(UTC))
    wait_for(lambda: daemon.current_run, why=lambda: f"no run started; the last tick: {daemon.last_tick}")
    stopping = threading.Thread(target=daemon.shutdown, daemon=True)
    stopping.start()
    stopping.join(60)
    assert not stopping.is_alive(), "shutdown() did not return while a scheduled run was stopping"
    runs = daemon.loop.runs.runs()
    assert len(runs) == 1 and runs[0].outcome == RunOutcome.ABANDONED, runs
    assert daemon.tick().decision.reason == "the daemon is stopping"


def test_a_tick_without_a_trigger_does_not_run(make_loop: Callable[..., Loop], consent_id: str) -> None:
    loop = make_loop(HOURLY.replace("min_new_traces: 10", "min_new_traces: 1000"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 40)
    report = daemon_of(loop).tick()
    assert not report.decision.train and "40 new consented traces of 1000 needed" in report.decision.reason
    assert loop.runs.runs() == []


def test_a_tick_that_finds_mlflow_down_looks_again_within_a_minute(make_loop: Callable[..., Loop]) -> None:
    dead = DrafterRegistry("http://127.0.0.1:9", timeout_s=1)  # nothing listens on the discard port
    daemon = daemon_of(make_loop(HOURLY, registry=dead))
    report = daemon.tick()
    assert not report.decision.train and report.decision.reason.startswith("MLflow unavailable")
    again = daemon.scheduler.get_job(f"{tick_job_id(daemon.base_model)}-retry")
    assert again is not None and again.func is scheduled_tick  # the hourly schedule's next tick is not the next look
    assert timedelta(seconds=50) < again.trigger.run_date - report.at < timedelta(seconds=RETRY_TICK_S + 10)


def test_traces_counted_by_a_run_do_not_trigger_the_next(make_loop: Callable[..., Loop], consent_id: str) -> None:
    loop = make_loop(HOURLY)
    store_traces(loop.settings.traces_root, loop.target, consent_id, 40)
    daemon = daemon_of(loop)
    assert daemon.tick().decision.train
    again = daemon.tick()
    assert not again.decision.train and again.decision.reason.startswith("no trigger: 0 new")


def test_health_metrics_and_status_over_http(make_loop: Callable[..., Loop], consent_id: str, tmp_path: Path) -> None:
    loop = make_loop(HOURLY)
    store_traces(loop.settings.traces_root, loop.target, consent_id, 40)
    seed_champion(loop, tmp_path)
    daemon = daemon_of(loop)
    with serve_in_thread(daemon_app(daemon)) as url:
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["base_model"] == loop.base_model and health["next_tick"]
        daemon.tick()
        metrics = httpx.get(f"{url}/metrics").text
        assert 'specloop_daemon_runs_total{outcome="promoted"} 1.0' in metrics
        assert 'specloop_daemon_gate_decisions_total{verdict="promote"} 1.0' in metrics
        assert 'specloop_daemon_step_seconds_count{step="train"} 1.0' in metrics
        assert 'specloop_daemon_gate_tau{contender="challenger"}' in metrics
        status = httpx.get(f"{url}/status").json()
        assert status["champion"]["version"] == "v2" and status["last_runs"][0]["outcome"] == "promoted"
        assert status["history"][0]["action"] == "promoted"
    assert not daemon.scheduler.running  # the lifespan shut it down


def test_two_daemons_on_one_state_database_watch_one_at_a_time(make_loop: Callable[..., Loop]) -> None:
    """A fleet's daemons share the state database: one of them watches (live τ, rollbacks, erasures);
    the other takes over when it stops."""
    loop = make_loop(HOURLY)
    first, second = daemon_of(loop), daemon_of(loop)
    assert [first._has_duty(), second._has_duty(), first._has_duty()] == [True, False, True]
    first.shutdown()
    assert second._has_duty()
    second.shutdown()


def test_mlflow_away_is_said_once_and_its_return_once(caplog: pytest.LogCaptureFixture) -> None:
    away: set[str] = set()

    def down() -> None:
        raise RegistryUnavailable("MLflow at http://mlflow:5000: connection refused")

    with caplog.at_level("INFO", logger="specloop.daemon.retrain.service"):
        for job in (down, down, down, lambda: None, lambda: None, down):
            _survive("watch", job, away)
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[1].strip() for m in said] == ["MLflow unavailable", "MLflow answers again",
                                                        "MLflow unavailable"]

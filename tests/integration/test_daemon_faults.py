"""The daemon as its own process, SIGKILLed in the middle of training and started again: nothing
was registered by the killed run, its lease expired instead of blocking, the restarted daemon
records the killed run as abandoned and its own run proceeds to a fully tagged version; SIGTERM
then stops it cleanly."""

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specloop.consent.registry import ConsentRegistry
from specloop.daemon.child_command import specloop_command
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.state_db import open_state
from specloop.engine.loaders.load import LoadedModel
from specloop.storage.broker import free_port
from specloop.storage.registry import DrafterRegistry, Tag
from tests.daemon.retrain.conftest import SUBJECT, TENANT, store_traces

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

POLICY = """
schedule: {{interval_minutes: 0.05}}
triggers: {{min_new_traces: 10, first_drafter: false}}
data: {{min_traces: 10}}
training: {{max_steps: {steps}, max_minutes: 5, batch_size: 2, anchors: 8, block_size: 4}}
evaluation: {{heldout_fraction: 0.25, min_heldout: 4}}
gate: {{min_relative_gain: 0.0}}
cooldown_minutes: 0
"""


def start_daemon(tmp_path: Path, model: Path, steps: int, log: Path) -> subprocess.Popen:
    policy = tmp_path / f"policy-{steps}.yaml"
    policy.write_text(POLICY.format(steps=steps))
    env = {**os.environ, "SPECLOOP_DAEMON_LEASE_TTL_S": "3"}
    command = specloop_command("daemon", "--policy", str(policy), "--registry", f"sqlite:///{tmp_path / 'mlflow.db'}",
                               "--traces-root", str(tmp_path / "traces"), "--consent-db", str(tmp_path / "consent.db"),
                               "--state-db", f"sqlite:///{tmp_path / 'state.db'}", "--work-dir", str(tmp_path / "runs"),
                               "--model", str(model), "--port", str(free_port()))
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(check: Callable[[], object], daemon: subprocess.Popen, log: Path, timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert daemon.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    return value


def test_sigkill_mid_run_then_restart(tiny_hf_model: Callable[[str], Path], deep_loaded: LoadedModel,
                                      tmp_path: Path) -> None:
    consent = ConsentRegistry(tmp_path / "consent.db")
    consent_id = consent.grant(TENANT, SUBJECT, "drafter_training", "2026-01", "test").consent_id
    consent.close()
    store_traces(tmp_path / "traces", deep_loaded, consent_id, 40)
    model, log = tiny_hf_model("llama-deep"), tmp_path / "daemon.log"
    runs = RunLog(open_state(f"sqlite:///{tmp_path / 'state.db'}"))

    first = start_daemon(tmp_path, model, steps=100_000, log=log)  # trains until killed
    try:
        wait_for(lambda: any(r.step == "train" and r.outcome is RunOutcome.RUNNING for r in runs.runs()), first, log)
        time.sleep(1.0)
    finally:
        first.kill()
        first.wait()
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert registry.versions(deep_loaded.fingerprint) == []  # nothing half-registered

    second = start_daemon(tmp_path, model, steps=10, log=log)
    try:
        trained = (RunOutcome.PROMOTED, RunOutcome.REFUSED)
        wait_for(lambda: any(r.outcome in trained for r in runs.runs()), second, log)
        second.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down gracefully: systemd counts that as clean.
        assert second.wait(timeout=90) in (0, -signal.SIGTERM), log.read_text()[-3000:]
        assert "Application shutdown complete" in log.read_text()
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    killed, *later = runs.runs()
    assert killed.outcome is RunOutcome.ABANDONED and "at step train" in killed.detail
    done = next(r for r in later if r.outcome in trained)
    (version,) = [v for v in registry.versions(deep_loaded.fingerprint) if v.tags.get(Tag.RUN) == done.run_id]
    assert version.tags[Tag.GATE] in ("promote", "refuse") and version.tags[Tag.EVAL_SET]
    assert len(registry.versions(deep_loaded.fingerprint)) == sum(r.version is not None for r in runs.runs())

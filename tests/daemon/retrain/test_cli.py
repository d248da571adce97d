"""`specloop status` and `specloop approve` against a real MLflow registry (SQLite) and state
database, and `specloop daemon`'s option checks."""

from datetime import UTC, datetime
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specloop.daemon.retrain import cli
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.promotion import await_approval, settle_approval
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.state_db import open_state
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.storage.registry import CHALLENGER, CHAMPION, Approval, DrafterRegistry, Tag
from tests.dflash_helpers import tiny_drafter, tiny_target

FP = "00112233445566aa"


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    cli.register(app)
    return app


@pytest.fixture
def waiting(tmp_path: Path) -> tuple[str, str]:
    """A registry with champion v1 and challenger v2 waiting for approval; (registry URI, state URL)."""
    uri, state = f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'state.db'}"
    registry, db = DrafterRegistry(uri), open_state(state)
    art = save_drafter(tmp_path / "d", tiny_drafter(tiny_target()), FP, Lineage("sha256:0", 1, 0))
    v1 = registry.register(art, FP)
    registry.set_alias(FP, CHAMPION, v1.version)
    v2 = registry.register(art, FP, {Tag.APPROVAL: Approval.PENDING, Tag.RUN: "r1"})
    runs = RunLog(db)
    runs.start("r1", FP, datetime.now(UTC))
    runs.finish("r1", RunOutcome.AWAITING_APPROVAL, "v2 awaits approval", {"train": 10.0})
    await_approval(registry, PromotionHistory(db), v2, "passed; the policy requires approval", run_id="r1")
    return uri, state


def test_status_shows_champion_challenger_pending_runs_and_history(app: typer.Typer, waiting: tuple[str, str]) -> None:
    uri, state = waiting
    out = CliRunner().invoke(app, ["status", "--registry", uri, "--state-db", state])
    assert out.exit_code == 0, out.output
    assert f"base model {FP}" in out.output and "champion: v1" in out.output
    assert "challenger: v2" in out.output and "approval pending" in out.output
    assert "pending approvals: v2" in out.output and "run r1: awaiting_approval" in out.output
    assert "awaiting_approval v2 (was v1, by daemon)" in out.output
    as_json = CliRunner().invoke(app, ["status", "--registry", uri, "--state-db", state, "--json"])
    assert '"pending_approvals": [\n      "v2"\n    ]' in as_json.output
    assert "benched" not in out.output  # no contest has judged v1 yet
    DrafterRegistry(uri).set_tags(FP, "1", {Tag.SPEED_OVER_SUFFIX: "-0.034", Tag.BENCHED: "true"})
    out = CliRunner().invoke(app, ["status", "--registry", uri, "--state-db", state])
    assert "champion: v1 (τ None vs None; benched: -3.4% against suffix decoding alone" in out.output


def test_approve_then_the_watch_promotes(app: typer.Typer, waiting: tuple[str, str]) -> None:
    uri, state = waiting
    out = CliRunner().invoke(app, ["approve", "v2", "--registry", uri, "--state-db", state, "--reason", "looks good"])
    assert out.exit_code == 0 and "approval=approved" in out.output, out.output
    registry, history = DrafterRegistry(uri), PromotionHistory(open_state(state))
    assert registry.version(FP, "2").approval is Approval.APPROVED
    assert history.last(FP).action is Action.APPROVED and history.last(FP).reason == "looks good"
    assert settle_approval(registry, history, FP).action is Action.PROMOTED
    assert registry.champion(FP).version == "2" and registry.by_alias(FP, CHALLENGER) is None


def test_reject_is_recorded_once_with_who(app: typer.Typer, waiting: tuple[str, str]) -> None:
    uri, state = waiting
    assert CliRunner().invoke(app, ["approve", "2", "--reject", "--registry", uri, "--state-db", state]).exit_code == 0
    registry, history = DrafterRegistry(uri), PromotionHistory(open_state(state))
    settle_approval(registry, history, FP)
    assert [e.action for e in history.events(FP)] == [Action.AWAITING_APPROVAL, Action.REJECTED]
    assert registry.champion(FP).version == "1" and registry.by_alias(FP, CHALLENGER) is None


def test_approve_refuses_a_version_that_is_not_waiting(app: typer.Typer, waiting: tuple[str, str]) -> None:
    uri, state = waiting
    for version, message in (("v1", "v1 is not the challenger"), ("three", "a version number like 3 or v3")):
        out = CliRunner().invoke(app, ["approve", version, "--registry", uri, "--state-db", state])
        assert out.exit_code == 2 and message in out.output, out.output


def test_daemon_refuses_a_bad_policy_or_missing_settings(app: typer.Typer, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SPECLOOP_REGISTRY", "SPECLOOP_DAEMON_POLICY"):
        monkeypatch.delenv(var, raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule: {interval_minutes: 5}\ngate: {min_relative_gain: -2}\n")
    out = CliRunner().invoke(app, ["daemon", "--policy", str(bad), "--registry", "sqlite:///x.db"])
    assert out.exit_code == 2 and "gate.min_relative_gain (line 2)" in out.output, out.output
    missing = CliRunner().invoke(app, ["daemon", "--policy", str(bad)])
    assert missing.exit_code == 2 and "--registry" in missing.output, missing.output
    monkeypatch.setenv("SPECLOOP_NVFP4_EMBEDDING", "true")  # without SPECLOOP_WEIGHTS=nvfp4
    half = CliRunner().invoke(app, ["daemon", "--policy", str(bad), "--registry", "sqlite:///x.db"])
    words = " ".join(half.output.replace("│", " ").split())
    assert half.exit_code == 2 and "--nvfp4-embedding" in words and "needs weights 'nvfp4'" in words, half.output

"""`specloop replay` against a real served model: consent granted through the real admin API, requests
captured through the real broker and sink into Parquet, held-out prompts never sent.

The server is `tests/integration/conftest.py`'s `stack` (the tiny random Llama with n-gram
speculation, wired as `specloop serve --kafka-bootstrap` wires it); the command runs in-process
through typer's test runner. The split and the send loop also have tests of their own that need no
server.
"""

import json
import random
import socket
import time
from concurrent.futures import Future
from pathlib import Path

import duckdb
import httpx
import pytest
import typer
from typer.testing import CliRunner, Result

from specloop.daemon.traffic import sender
from specloop.daemon.training.prompts import Prompt, read_prompts
from specloop.storage.layout import live_files
from tests.engine.server import conftest as server_fixtures
from tests.integration import conftest as capture_fixtures
from tests.integration.conftest import ACME_KEY, CaptureStack

# Fixtures, used by name: this module's own `stack` (module scope), on the session's tiny model.
stack = capture_fixtures.stack
tiny_loaded = server_fixtures.tiny_loaded
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _app() -> typer.Typer:
    app = typer.Typer()
    sender.register(app)
    return app


def _invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(_app(), list(args), env=env)


def _prompts_file(path: Path, n: int) -> Path:
    # Repeated words give the n-gram drafter something to draft from.
    lines = [json.dumps({"messages": [{"role": "user", "content": f"{w} {i} " * 4}]})
             for i, w in enumerate(WORDS[:n])]
    path.write_text("\n".join(lines) + "\n")
    return path


def _stack_args(stack: CaptureStack, *extra: str) -> list[str]:
    return ["--url", stack.base_url, "--api-key", ACME_KEY, "--tenant", "acme",
            "--admin-token", stack.consent.admin_token, *extra]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trace_rows(root: Path, subjects: list[str], expected: int, timeout_s: float = 30.0) -> list[dict]:
    """The Parquet rows of `subjects`, once `expected` of them have arrived (the sink flushes every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        files = [str(p) for p in live_files(root)]
        if files:
            relation = duckdb.execute("SELECT subject, prompt_text FROM read_parquet($files) "
                                      "WHERE list_contains($subjects, subject)", {"files": files, "subjects": subjects})
            rows = [{"subject": s, "prompt_text": t} for s, t in relation.fetchall()]
            if len(rows) >= expected:
                return rows
        time.sleep(0.2)
    raise AssertionError(f"{len(rows)} of {expected} traces reached Parquet under {root}")


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------------- no server


def _many_prompts(n: int) -> list[Prompt]:
    return [Prompt("file", f"p{i}", ({"role": "user", "content": f"question {i}"},)) for i in range(n)]


def test_the_split_is_deterministic_disjoint_and_independent_of_order() -> None:
    prompts = _many_prompts(400)
    traffic, heldout = sender.traffic_split(prompts, 0.25)
    shuffled = random.Random(0).sample(prompts, len(prompts))
    traffic_again, heldout_again = sender.traffic_split(shuffled, 0.25)
    assert {p.task for p in traffic} == {p.task for p in traffic_again}
    assert {p.task for p in heldout} == {p.task for p in heldout_again}
    assert {p.task for p in traffic}.isdisjoint({p.task for p in heldout})
    assert len(traffic) + len(heldout) == 400
    assert 60 <= len(heldout) <= 140  # sha256 buckets are uniform: 100 expected
    # A prompt's side depends on its messages alone, not on which other prompts are split with it.
    assert sender.traffic_split(heldout[:5], 0.25) == ([], heldout[:5])
    assert sender.traffic_split(prompts, 0.0) == (prompts, [])


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="held-out fraction"):
        sender.traffic_split(_many_prompts(3), 1.0)


def test_the_loop_stops_once_the_engine_has_been_unreachable_long_enough() -> None:
    def unreachable(job: sender.Job) -> Future:
        f: Future = Future()
        f.set_result(sender.RequestOutcome(at="", task=job.prompt.task, user=job.user, latency_s=0.0, status=None,
                                    error="ConnectError: refused"))
        time.sleep(0.01)
        return f

    done: list[sender.RequestOutcome] = []
    liveness = sender.Liveness(dead_after_s=0.2)
    endless = sender.job_stream(_many_prompts(2), ["user-0"], repeat=True, limit=None)
    sender.drive(endless, unreachable, 2, None, done.append, liveness, lambda: None)
    assert liveness.dead() and liveness.last_error == "ConnectError: refused"
    assert done and all(o.status is None for o in done)


def test_nothing_is_sent_while_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender, "PAUSE_POLL_S", 0.01)
    sent_at: list[float] = []

    def ok(job: sender.Job) -> Future:
        sent_at.append(time.monotonic())
        f: Future = Future()
        f.set_result(sender.RequestOutcome(at="", task=job.prompt.task, user=job.user, latency_s=0.0, status=200))
        return f

    resume_at = time.monotonic() + 0.3
    jobs = sender.job_stream(_many_prompts(3), ["user-0"], repeat=False, limit=None)
    sender.drive(jobs, ok, 1, None, lambda _: None, sender.Liveness(dead_after_s=5), lambda: None,
                 paused=lambda: time.monotonic() < resume_at)
    assert len(sent_at) == 3 and min(sent_at) >= resume_at


def test_jobs_cycle_with_repeat_and_take_users_in_turn() -> None:
    prompts = _many_prompts(3)
    sent = list(sender.job_stream(prompts, ["user-0", "user-1"], repeat=True, limit=7))
    assert [j.prompt.task for j in sent] == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]
    assert [j.user for j in sent] == ["user-0", "user-1"] * 3 + ["user-0"]
    assert len(list(sender.job_stream(prompts, ["user-0"], repeat=False, limit=None))) == 3


@pytest.mark.parametrize(("args", "option"), [
    (["--concurrency", "0"], "--concurrency"),
    (["--users", "0"], "--users"),
    (["--heldout-fraction", "1"], "--heldout-fraction"),
    (["--duration-s", "0"], "--duration-s"),
    (["--source", "file"], "--prompts-file"),
])
def test_bad_options_are_refused_naming_the_option(args: list[str], option: str) -> None:
    result = _invoke("--api-key", "k", "--tenant", "acme", "--admin-token", "t", *args)
    assert result.exit_code == 2, result.output
    assert f"'{option}'" in result.output


def test_without_an_admin_token_the_command_is_refused() -> None:
    result = _invoke("--api-key", "k", "--tenant", "acme", env={"SPECLOOP_ADMIN_TOKEN": ""})
    assert result.exit_code == 2, result.output
    assert "'--admin-token'" in result.output


def test_a_dead_engine_ends_the_command_with_exit_1(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _invoke("--url", _closed_port_url(), "--api-key", "k", "--tenant", "acme", "--admin-token", "t",
                     "--source", "file", "--prompts-file", str(_prompts_file(tmp_path / "p.jsonl", 3)),
                     "--dead-after-s", "0.5")
    assert result.exit_code == 1, result.output
    assert "unreachable for 0.5 s" in result.stderr
    assert time.monotonic() - started < 10


# ----------------------------------------------------------------------------------------- a server


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_replay_sends_each_traffic_prompt_once_as_consented_demo_users(stack: CaptureStack, tmp_path: Path) -> None:
    prompts_file = _prompts_file(tmp_path / "prompts.jsonl", 12)
    traffic, heldout = sender.traffic_split(read_prompts(prompts_file), 0.25)
    assert (len(traffic), len(heldout)) == (10, 2)  # the split of these 12 prompts is fixed
    record = tmp_path / "sender.jsonl"
    result = CliRunner().invoke(_app(), _stack_args(
        stack, "--source", "file", "--prompts-file", str(prompts_file), "--users", "3", "--concurrency", "2",
        "--max-tokens", "16", "--record", str(record)))
    assert result.exit_code == 0, result.output

    records = _records(record)
    assert sorted(r["task"] for r in records) == sorted(p.task for p in traffic)
    assert all(r["status"] == 200 and r["tau"] >= 1 and r["completion_tokens"] > 0 for r in records)
    assert {r["user"] for r in records} == {"user-0", "user-1", "user-2"}
    # usage.speculation was read: the n-gram drafter drafted in some requests, and τ is 1 + accepted / drafts.
    assert any(r["drafts"] > 0 for r in records)
    assert all(r["tau"] == pytest.approx(1 + r["accepted_tokens"] / r["drafts"]) for r in records if r["drafts"])
    summary = json.loads(result.stdout)
    assert (summary["requests"], summary["failures"]) == (len(traffic), 0)
    assert (summary["traffic_prompts"], summary["heldout_prompts"]) == (len(traffic), len(heldout))
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert summary["tau"] >= 1 and set(summary["by_drafter_version"]) == {"none"}

    for user in ("user-0", "user-1", "user-2"):
        held = stack.admin("/consents/query", {"tenant": "acme", "user": user}).json()["data"]
        assert [(r["source"], r["revoked_at"]) for r in held] == [(sender.CONSENT_SOURCE, None)]
    subjects = [stack.subject("acme", f"user-{i}") for i in range(3)]
    rows = _trace_rows(stack.consent.traces_root, subjects, len(traffic))
    assert len(rows) == len(traffic)
    sent_text = "\n".join(r["prompt_text"] for r in rows)
    assert all(p.messages[0]["content"] in sent_text for p in traffic)
    assert not any(p.messages[0]["content"] in sent_text for p in heldout)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_consent_is_granted_once_however_often_the_demo_runs(stack: CaptureStack) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        assert sender.grant_consents(client, stack.consent.admin_token, "acme", ["again-0", "again-1"]) == 2
        assert sender.grant_consents(client, stack.consent.admin_token, "acme", ["again-0", "again-1"]) == 0
    assert len(stack.admin("/consents/query", {"tenant": "acme", "user": "again-0"}).json()["data"]) == 1


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_refused_requests_are_recorded_and_counted_not_fatal(stack: CaptureStack, tmp_path: Path) -> None:
    record = tmp_path / "sender.jsonl"
    # The tiny model's context is 256 tokens, so every request asking for 1,000 is refused with a 400.
    result = CliRunner().invoke(_app(), _stack_args(
        stack, "--source", "file", "--prompts-file", str(_prompts_file(tmp_path / "p.jsonl", 4)),
        "--heldout-fraction", "0", "--max-tokens", "1000", "--record", str(record)))
    assert result.exit_code == 0, result.output
    records = _records(record)
    assert [r["status"] for r in records] == [400] * 4
    assert all("context" in r["error"] and r["tau"] is None for r in records)
    assert json.loads(result.stdout)["failures"] == 4


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_wrong_key_admin_token_or_tenant_is_refused_naming_the_option(stack: CaptureStack, tmp_path: Path) -> None:
    prompts = ["--source", "file", "--prompts-file", str(_prompts_file(tmp_path / "p.jsonl", 2))]
    wrong_key = _stack_args(stack, *prompts)
    wrong_key[wrong_key.index(ACME_KEY)] = "not-a-key-of-anyone-at-all"
    result = CliRunner().invoke(_app(), wrong_key)
    assert result.exit_code == 2 and "'--api-key'" in result.output, result.output
    result = CliRunner().invoke(_app(), [*_stack_args(stack, *prompts), "--admin-token", "wrong-token-0123"])
    assert result.exit_code == 2 and "'--admin-token'" in result.output, result.output
    result = CliRunner().invoke(_app(), [*_stack_args(stack, *prompts), "--tenant", "nobody"])
    assert result.exit_code == 2 and "'--tenant'" in result.output and "nobody" in result.output, result.output


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_repeat_cycles_the_prompts_until_the_duration_is_up(stack: CaptureStack, tmp_path: Path) -> None:
    record = tmp_path / "sender.jsonl"
    started = time.monotonic()
    result = CliRunner().invoke(_app(), _stack_args(
        stack, "--source", "file", "--prompts-file", str(_prompts_file(tmp_path / "p.jsonl", 2)),
        "--heldout-fraction", "0", "--max-tokens", "4", "--repeat", "--duration-s", "1.5", "--record", str(record)))
    assert result.exit_code == 0, result.output
    assert 1.5 <= time.monotonic() - started < 30
    tasks = [r["task"] for r in _records(record)]
    assert len(tasks) > 2 and set(tasks) == {"p.jsonl:1", "p.jsonl:2"}

"""`specloop consent grant|revoke|list` through typer's CliRunner, on a real registry file."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specloop.consent.cli import register
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.storage.erasure import erase_subject

STRONG_KEY = "q8Vn2LrT5wXy7Zb1Cd4Ef6Gh9Jk3Mn0Pq"


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., object]:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: acme\n    capture_allowed: true\n"
                       "    policy_version: '2025-06'\n")
    for name in ("HMAC_KEY", "ADMIN_TOKEN", "CONSENT_DB", "AUDIT_LOG", "TRACES_ROOT"):
        monkeypatch.delenv(f"SPECLOOP_{name}", raising=False)
    monkeypatch.setenv("SPECLOOP_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECLOOP_TENANTS_FILE", str(tenants))
    monkeypatch.setenv("SPECLOOP_HMAC_KEY", STRONG_KEY)
    app = typer.Typer()
    register(app, erase_subject)

    def invoke(*args: str) -> object:
        return CliRunner().invoke(app, ["consent", *args])

    return invoke


def registry_at(tmp_path: Path) -> ConsentRegistry:
    return ConsentRegistry(tmp_path / "data" / "consent.db")


def test_grant_list_revoke(run: Callable[..., object], tmp_path: Path) -> None:
    result = run("grant", "--tenant", "acme", "--user", "alice",
                 "--expires-at", "2099-01-01T00:00:00+00:00")
    assert result.exit_code == 0, result.output
    granted = json.loads(result.stdout)
    subject = Pseudonymizer(STRONG_KEY.encode()).subject("acme", "alice")
    assert granted["subject"] == subject and granted["source"] == "cli"

    listed = run("list", "--tenant", "acme", "--user", "alice", "--json")
    assert [json.loads(x)["consent_id"] for x in listed.stdout.splitlines()] == [
        granted["consent_id"]]
    table = run("list")
    assert table.exit_code == 0 and granted["consent_id"] in table.stdout

    revoked = run("revoke", "--tenant", "acme", "--subject", subject)
    assert revoked.exit_code == 0, revoked.output
    assert json.loads(revoked.stdout)["revoked"][0]["revoked_at"]
    registry = registry_at(tmp_path)
    assert registry.list(subject=subject)[0].revoked_at is not None
    registry.close()
    audit = (tmp_path / "data" / "consent-audit.jsonl").read_text()
    assert '"actor": "cli:' in audit and "alice" not in audit


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("grant", "--tenant", "nope", "--user", "a"), "--tenant"),
        (("grant", "--tenant", "acme"), "--user"),
        (("grant", "--tenant", "acme", "--user", "a", "--expires-at", "tomorrow"), "--expires-at"),
        (("grant", "--tenant", "acme", "--user", "a", "--expires-at", "2099-01-01"), "--expires-at"),
        (("revoke", "--tenant", "acme", "--subject", "not-a-pseudonym"), "--subject"),
    ],
)
def test_operator_errors_exit_2_naming_the_option(run: Callable[..., object], args: tuple,
                                                  message: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert f"error: {message}" in result.stderr


def test_weak_key_refused(run: Callable[..., object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECLOOP_HMAC_KEY", "changeme")
    result = run("list")
    assert result.exit_code == 2 and "hmac_key" in result.stderr


def test_revoke_with_erase(run: Callable[..., object], tmp_path: Path,
                           write_traces: Callable[[list[tuple[str, str]], int], Path],
                           subject_rows: Callable[[str, str], int],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("specloop.storage.erasure")
    monkeypatch.setenv("SPECLOOP_TRACES_ROOT", str(tmp_path / "traces"))  # where write_traces writes
    subject = Pseudonymizer(STRONG_KEY.encode()).subject("acme", "bob")
    assert run("grant", "--tenant", "acme", "--user", "bob").exit_code == 0
    write_traces([("acme", subject), ("acme", subject)], 0)
    result = run("revoke", "--tenant", "acme", "--user", "bob", "--erase")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["erasure"]["erasure"]["rows_removed"] == 2
    assert subject_rows("acme", subject) == 0

"""Revoke-and-erase against real Parquet files written by storage, and the audit log.

consent does not import storage; these tests join them as the engine and the CLI do, by handing
storage's `erase_subject` to `revoke_and_erase`."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from specloop.consent.erasure import revoke_and_erase
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.consent.settings import ConsentConfig
from specloop.storage.erasure import erase_subject

WriteTraces = Callable[[list[tuple[str, str]], int], Path]


def test_revoke_and_erase(registry: ConsentRegistry, config: ConsentConfig,
                          pseudonymizer: Pseudonymizer, write_traces: WriteTraces,
                          subject_rows: Callable[[str, str], int]) -> None:
    gone, kept = pseudonymizer.subject("acme", "u-gone"), pseudonymizer.subject("acme", "u-kept")
    same_subject_other_tenant = ("globex", gone)  # erasure is per tenant
    consent = registry.grant("acme", gone, "drafter_training", "v1", "test")
    write_traces([("acme", gone), ("acme", kept), ("acme", gone)], 0)
    write_traces([("acme", kept), same_subject_other_tenant], 3)
    untouched = write_traces([("acme", kept)], 5)
    before = untouched.stat().st_mtime_ns
    assert subject_rows("acme", gone) == 2

    revoked, entry = revoke_and_erase(registry, erase_subject, config.traces_root, config.work_dir, "acme", gone,
                                      config.audit_log_path, actor="test:ops")

    assert [r.consent_id for r in revoked] == [consent.consent_id]
    assert registry.active("acme", gone, "drafter_training", revoked[0].revoked_at) is None
    assert subject_rows("acme", gone) == 0
    assert subject_rows("acme", kept) == 3
    assert subject_rows("globex", gone) == 1
    assert untouched.stat().st_mtime_ns == before
    [line] = config.audit_log_path.read_text().splitlines()
    logged = json.loads(line)
    assert logged == entry
    assert (logged["event"], logged["actor"], logged["status"]) == ("revoke_and_erase", "test:ops", "ok")
    assert (logged["tenant"], logged["subject"]) == ("acme", gone)
    assert logged["consents_revoked"] == [consent.consent_id]
    assert logged["erasure"]["rows_removed"] == 2
    assert len(logged["erasure"]["files_rewritten"]) == 1
    assert "u-gone" not in config.audit_log_path.read_text()


def test_erase_is_repeatable(registry: ConsentRegistry, config: ConsentConfig,
                             pseudonymizer: Pseudonymizer, write_traces: WriteTraces) -> None:
    subject = pseudonymizer.subject("acme", "u1")
    write_traces([("acme", subject)], 0)
    for _ in range(2):
        revoke_and_erase(registry, erase_subject, config.traces_root, config.work_dir, "acme", subject,
                         config.audit_log_path, actor="test")
    entries = [json.loads(x) for x in config.audit_log_path.read_text().splitlines()]
    assert [e["erasure"]["rows_removed"] for e in entries] == [1, 0]


def test_failed_erasure_is_audited_and_raised(
    registry: ConsentRegistry, config: ConsentConfig, pseudonymizer: Pseudonymizer
) -> None:
    def broken(root: Path, tenant: str, subject: str, work_dir: Path) -> None:
        raise OSError("disk full")

    subject = pseudonymizer.subject("acme", "u1")
    registry.grant("acme", subject, "drafter_training", "v1", "test")
    with pytest.raises(OSError, match="disk full"):
        revoke_and_erase(registry, broken, config.traces_root, config.work_dir, "acme", subject, config.audit_log_path, actor="test")
    [entry] = [json.loads(x) for x in config.audit_log_path.read_text().splitlines()]
    assert entry["status"] == "failed" and "disk full" in entry["error"]
    assert registry.list(subject=subject)[0].revoked_at is not None  # revoked even so



def test_a_wrong_traces_root_is_an_error_not_an_empty_success(
    registry: ConsentRegistry, config: ConsentConfig, pseudonymizer: Pseudonymizer, tmp_path: Path
) -> None:
    subject = pseudonymizer.subject("acme", "u1")
    registry.grant("acme", subject, "drafter_training", "v1", "test")
    wrong = tmp_path / "no-such-traces"
    with pytest.raises(FileNotFoundError, match="nothing was erased"):
        revoke_and_erase(registry, erase_subject, wrong, config.work_dir, "acme", subject, config.audit_log_path, actor="test")
    assert not wrong.exists()
    [entry] = [json.loads(x) for x in config.audit_log_path.read_text().splitlines()]
    assert entry["status"] == "failed" and "no-such-traces" in entry["error"]

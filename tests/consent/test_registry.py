"""The SQLite consent registry: migrations, grant/revoke/expire, lookups, snapshot, threads."""

import multiprocessing
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from specloop.consent.registry import MIGRATIONS, ConsentRegistry, InvalidField, migrate

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
S1 = "1" * 64
S2 = "2" * 64
PURPOSE = "drafter_training"


def test_fresh_file_at_latest_version(registry: ConsentRegistry) -> None:
    conn = sqlite3.connect(registry.path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrates_version_1_file_keeping_rows(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate(conn, target=1) == 1
    granted = int((T0 - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1e6)
    conn.execute("INSERT INTO consent VALUES ('c-old', 'acme', ?, ?, 'v0', ?, NULL, 'legacy')",
                 (S1, PURPOSE, granted))
    conn.close()

    registry = ConsentRegistry(path)
    [record] = registry.list()
    assert (record.consent_id, record.granted_at, record.expires_at) == ("c-old", T0, None)
    assert registry.active("acme", S1, PURPOSE, T0 + timedelta(days=1)) == record
    later = registry.grant("acme", S2, PURPOSE, "v1", "test", T0, expires_at=T0 + timedelta(days=1))
    assert registry.list(subject=S2) == [later]
    registry.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_refuses_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(ValueError, match="newer"):
        ConsentRegistry(path)


def test_grant_revoke_expire(registry: ConsentRegistry) -> None:
    rec = registry.grant("acme", S1, PURPOSE, "v1", "test", T0, T0 + timedelta(days=30))
    assert registry.active("acme", S1, PURPOSE, T0 - timedelta(seconds=1)) is None
    assert registry.active("acme", S1, PURPOSE, T0) == rec
    assert registry.active("acme", S1, PURPOSE, T0 + timedelta(days=30)) is None  # expired
    assert registry.active("acme", S1, "other_purpose", T0) is None
    assert registry.active("globex", S1, PURPOSE, T0) is None

    [revoked] = registry.revoke("acme", S1, PURPOSE, at=T0 + timedelta(days=1))
    assert revoked.revoked_at == T0 + timedelta(days=1)
    assert registry.active("acme", S1, PURPOSE, T0 + timedelta(hours=23)) == revoked
    assert registry.active("acme", S1, PURPOSE, T0 + timedelta(days=1)) is None
    assert registry.latest("acme", S1, PURPOSE, T0 + timedelta(days=2)) == revoked
    assert registry.revoke("acme", S1, PURPOSE, at=T0 + timedelta(days=2)) == []

    regrant = registry.grant("acme", S1, PURPOSE, "v2", "test", T0 + timedelta(days=3))
    assert registry.active("acme", S1, PURPOSE, T0 + timedelta(days=400)) == regrant


def test_revoke_all_purposes_only_touches_subject(registry: ConsentRegistry) -> None:
    registry.grant("acme", S1, PURPOSE, "v1", "test", T0)
    registry.grant("acme", S1, "evaluation", "v1", "test", T0)
    keep = registry.grant("acme", S2, PURPOSE, "v1", "test", T0)
    assert len(registry.revoke("acme", S1, at=T0 + timedelta(hours=1))) == 2
    assert registry.active("acme", S2, PURPOSE, T0 + timedelta(hours=2)) == keep


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("purpose", {"purpose": "Drafter Training"}),
        ("policy_version", {"policy_version": ""}),
        ("granted_at", {"granted_at": datetime(2025, 1, 1)}),
        ("expires_at", {"expires_at": T0 - timedelta(days=1)}),
        ("tenant", {"tenant": ""}),
    ],
)
def test_grant_errors_name_the_field(registry: ConsentRegistry, field: str, kwargs: dict) -> None:
    args = {"tenant": "acme", "subject": S1, "purpose": PURPOSE, "policy_version": "v1",
            "source": "test", "granted_at": T0} | kwargs
    with pytest.raises(InvalidField) as err:
        registry.grant(**args)
    assert err.value.field == field


def test_snapshot_columns_and_values(registry: ConsentRegistry) -> None:
    a = registry.grant("acme", S1, PURPOSE, "v1", "test", T0, T0 + timedelta(days=1))
    registry.grant("acme", S2, PURPOSE, "v1", "test", T0 + timedelta(hours=1))
    registry.grant("acme", S2, "evaluation", "v1", "test", T0)
    registry.revoke("acme", S2, PURPOSE, at=T0 + timedelta(hours=2))
    table = registry.snapshot(PURPOSE)
    ts = pa.timestamp("us", tz="UTC")
    assert table.schema == pa.schema(
        [("consent_id", pa.string()), ("tenant", pa.string()), ("subject", pa.string()),
         ("purpose", pa.string()), ("policy_version", pa.string()), ("granted_at", ts),
         ("expires_at", ts), ("revoked_at", ts)]
    )
    rows = table.to_pylist()
    assert [r["subject"] for r in rows] == [S1, S2]
    assert rows[0]["consent_id"] == a.consent_id
    assert rows[0]["expires_at"] == T0 + timedelta(days=1) and rows[0]["revoked_at"] is None
    assert rows[1]["expires_at"] is None and rows[1]["revoked_at"] == T0 + timedelta(hours=2)
    assert registry.snapshot("nothing_here").num_rows == 0
    assert registry.snapshot("nothing_here").schema == table.schema


def test_concurrent_threads_and_second_process_view(registry: ConsentRegistry) -> None:
    subjects = [f"{i:064x}" for i in range(8)]
    errors: list[BaseException] = []

    def work(subject: str) -> None:
        try:
            for _ in range(20):
                registry.grant("acme", subject, PURPOSE, "v1", "test", T0)
                assert registry.active("acme", subject, PURPOSE, T0) is not None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in subjects]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    other = ConsentRegistry(registry.path)  # e.g. the CLI while the engine serves
    assert len(other.list(tenant="acme")) == 160
    other.revoke("acme", subjects[0], at=T0 + timedelta(seconds=1))
    other.close()
    assert registry.active("acme", subjects[0], PURPOSE, T0 + timedelta(seconds=2)) is None


def _open_at_once(path: Path, barrier: "multiprocessing.synchronize.Barrier") -> None:
    barrier.wait()
    ConsentRegistry(path).close()


def test_processes_opening_a_new_file_at_once_all_succeed(tmp_path: Path) -> None:
    """Engine replicas start together on one consent volume: the first start of `specloop fleet`
    failed one of two with "database is locked" on the switch to WAL (1 process in 80 here without
    the retry, 4 at a time over 20 new files)."""
    context = multiprocessing.get_context("fork")
    for attempt in range(20):
        barrier = context.Barrier(4)
        processes = [context.Process(target=_open_at_once, args=(tmp_path / f"{attempt}.db", barrier))
                     for _ in range(4)]
        for p in processes:
            p.start()
        for p in processes:
            p.join(30)
        assert [p.exitcode for p in processes] == [0] * 4, attempt

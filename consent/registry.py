"""The consent registry: one SQLite file of consent records, with ordered schema migrations.

A record says that a subject (a pseudonym, never a raw user id) of a tenant agreed, under a policy
version, that their traffic may be used for a purpose, from `granted_at` until it expires or is
revoked. Records are never deleted: revocation stamps `revoked_at`, so the history stays auditable
and a dataset build can join against the full table (`snapshot`). This module is not the capture
decision (`specloop.consent.capture`) and does not erase traces (`specloop.consent.erasure`).

Timestamps are stored as integer microseconds since the Unix epoch, UTC; the API takes and returns
timezone-aware datetimes only. One connection serves all threads behind a lock: WAL mode lets other
processes (the CLI while the engine serves) read and write the same file concurrently.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa

from specloop.consent.pseudonym import is_pseudonym

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_IDS_PER_QUERY = 500  # bound parameters per statement; SQLite's default limit is 32,766
_PURPOSE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_COLUMNS = (
    "consent_id, tenant, subject, purpose, policy_version, granted_at, expires_at, revoked_at, "
    "source"
)

# Ordered migration steps: step i (1-based) moves the file from user_version i-1 to i. Never edit a
# released step; append a new one.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE consent (
            consent_id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            subject TEXT NOT NULL,
            purpose TEXT NOT NULL,
            policy_version TEXT NOT NULL,
            granted_at INTEGER NOT NULL,
            revoked_at INTEGER,
            source TEXT NOT NULL
        )""",
    ),
    (
        "ALTER TABLE consent ADD COLUMN expires_at INTEGER",
        "CREATE INDEX consent_lookup ON consent (tenant, subject, purpose, granted_at)",
    ),
)


class InvalidField(ValueError):
    """A value an operator or client can fix; `field` names it (the API reports it as `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ConsentRecord:
    consent_id: str
    tenant: str
    subject: str
    purpose: str
    policy_version: str
    granted_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    source: str

    def is_active(self, at: datetime) -> bool:
        """Granted at or before `at`, and neither revoked nor expired by then."""
        return (
            self.granted_at <= at
            and (self.revoked_at is None or at < self.revoked_at)
            and (self.expires_at is None or at < self.expires_at)
        )


def to_micros(at: datetime, field: str) -> int:
    """Microseconds since the epoch of an aware datetime; `field` names it in the error."""
    if at.tzinfo is None:
        raise InvalidField(field, f"must be timezone-aware, got {at.isoformat()}")
    return (at - _EPOCH) // timedelta(microseconds=1)


def _from_micros(micros: int | None) -> datetime | None:
    return None if micros is None else _EPOCH + timedelta(microseconds=micros)


def _record(row: Sequence) -> ConsentRecord:
    cid, tenant, subject, purpose, policy, granted, expires, revoked, source = row
    return ConsentRecord(
        cid, tenant, subject, purpose, policy, _from_micros(granted), _from_micros(expires),
        _from_micros(revoked), source,
    )


def migrate(conn: sqlite3.Connection, target: int = len(MIGRATIONS)) -> int:
    """Apply the missing migration steps up to `target`; returns the resulting schema version.

    Each step runs in its own IMMEDIATE transaction that re-reads the version, so two processes
    opening an old file at once apply every step exactly once.
    """
    assert 0 <= target <= len(MIGRATIONS)
    while True:
        conn.execute("BEGIN IMMEDIATE")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            conn.execute("ROLLBACK")
            raise ValueError(
                f"consent registry schema version {version} is newer than this specloop knows "
                f"({len(MIGRATIONS)}); upgrade specloop"
            )
        if version >= target:
            conn.execute("COMMIT")
            return version
        for statement in MIGRATIONS[version]:
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {version + 1}")
        conn.execute("COMMIT")


_WAL_SWITCH_S = 5.0


def _use_wal(conn: sqlite3.Connection) -> None:
    """WAL mode (kept in the file once set). Two processes opening a new file at once (engine
    replicas starting together) found the switch "database is locked" at once, the busy timeout not
    applying to it, so it is tried again for a few seconds."""
    deadline = time.monotonic() + _WAL_SWITCH_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class ConsentRegistry:
    """Grant, revoke, look up and snapshot consent records in one SQLite file. Thread-safe."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE) so writers never
        # upgrade a read lock and deadlock against another process.
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout = 5000")
        _use_wal(self._conn)
        # FULL: a revocation acknowledged to an admin must survive a power cut.
        self._conn.execute("PRAGMA synchronous = FULL")
        with self._lock:
            migrate(self._conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def grant(
        self,
        tenant: str,
        subject: str,
        purpose: str,
        policy_version: str,
        source: str,
        granted_at: datetime | None = None,
        expires_at: datetime | None = None,
    ) -> ConsentRecord:
        """Record a new consent and return it. Earlier records of the subject are left as they are."""
        granted_at = granted_at or datetime.now(UTC)
        _check_grant(tenant, subject, purpose, policy_version, source)
        granted = to_micros(granted_at, "granted_at")
        expires = None if expires_at is None else to_micros(expires_at, "expires_at")
        if expires is not None and expires <= granted:
            raise InvalidField("expires_at", "must be later than granted_at")
        row = (str(uuid.uuid4()), tenant, subject, purpose, policy_version, granted, expires, None,
               source)
        with self._lock:
            self._conn.execute(f"INSERT INTO consent ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)", row)
        return _record(row)

    def revoke(
        self, tenant: str, subject: str, purpose: str | None = None, at: datetime | None = None
    ) -> list[ConsentRecord]:
        """Revoke every record of the subject (for one purpose, or all) not yet revoked at `at`.

        Returns the records as they are after revocation; an empty list when none was in force.
        """
        revoked = to_micros(at or datetime.now(UTC), "at")
        where, params = _filters(tenant, subject, purpose)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                rows = self._conn.execute(
                    f"UPDATE consent SET revoked_at = ? WHERE {where} "
                    f"AND (revoked_at IS NULL OR revoked_at > ?) RETURNING {_COLUMNS}",
                    (revoked, *params, revoked),
                ).fetchall()
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return sorted((_record(r) for r in rows), key=lambda r: r.granted_at)

    def list(
        self, tenant: str | None = None, subject: str | None = None, purpose: str | None = None
    ) -> list[ConsentRecord]:
        """All records matching the given filters, oldest grant first."""
        where, params = _filters(tenant, subject, purpose)
        return [_record(r) for r in self._select(f"WHERE {where} ORDER BY granted_at", params)]

    def active(
        self, tenant: str, subject: str, purpose: str, at: datetime
    ) -> ConsentRecord | None:
        """The most recently granted record in force at `at`, or None."""
        t = to_micros(at, "at")
        rows = self._select(
            "WHERE tenant = ? AND subject = ? AND purpose = ? AND granted_at <= ? "
            "AND (revoked_at IS NULL OR revoked_at > ?) AND (expires_at IS NULL OR expires_at > ?) "
            "ORDER BY granted_at DESC LIMIT 1",
            (tenant, subject, purpose, t, t, t),
        )
        return _record(rows[0]) if rows else None

    def latest(self, tenant: str, subject: str, purpose: str, at: datetime) -> ConsentRecord | None:
        """The most recently granted record at or before `at`, in force or not, or None."""
        rows = self._select(
            "WHERE tenant = ? AND subject = ? AND purpose = ? AND granted_at <= ? "
            "ORDER BY granted_at DESC LIMIT 1",
            (tenant, subject, purpose, to_micros(at, "at")),
        )
        return _record(rows[0]) if rows else None

    def withdrawn(self, consent_ids: Iterable[str], at: datetime) -> list[str]:
        """The ids among `consent_ids` not in force at `at`: revoked, expired, or unknown here."""
        ids = sorted(set(consent_ids))
        in_force = set()
        for i in range(0, len(ids), _IDS_PER_QUERY):
            chunk = ids[i:i + _IDS_PER_QUERY]
            rows = self._select(f"WHERE consent_id IN ({', '.join('?' * len(chunk))})", chunk)
            in_force.update(r.consent_id for r in map(_record, rows) if r.is_active(at))
        return [i for i in ids if i not in in_force]

    def snapshot(self, purpose: str) -> pa.Table:
        """Every record for `purpose` (revoked and expired included) as an Arrow table.

        The dataset builder joins traces against it at build time and applies `is_active` itself,
        so consent revoked after capture still excludes the trace.
        """
        rows = self._select("WHERE purpose = ? ORDER BY granted_at", (purpose,))
        columns = list(zip(*rows)) if rows else [()] * 9
        ts = pa.timestamp("us", tz="UTC")
        return pa.table(
            {
                "consent_id": pa.array(columns[0], pa.string()),
                "tenant": pa.array(columns[1], pa.string()),
                "subject": pa.array(columns[2], pa.string()),
                "purpose": pa.array(columns[3], pa.string()),
                "policy_version": pa.array(columns[4], pa.string()),
                "granted_at": pa.array(columns[5], ts),
                "expires_at": pa.array(columns[6], ts),
                "revoked_at": pa.array(columns[7], ts),
            }
        )

    def _select(self, clause: str, params: Sequence) -> list[tuple]:
        with self._lock:
            return self._conn.execute(f"SELECT {_COLUMNS} FROM consent {clause}", params).fetchall()


def _filters(
    tenant: str | None, subject: str | None, purpose: str | None
) -> tuple[str, tuple[str, ...]]:
    pairs = [(c, v) for c, v in (("tenant", tenant), ("subject", subject), ("purpose", purpose))
             if v is not None]
    where = " AND ".join(f"{c} = ?" for c, _ in pairs) or "1"
    return where, tuple(v for _, v in pairs)


def _check_grant(tenant: str, subject: str, purpose: str, policy_version: str, source: str) -> None:
    if not tenant:
        raise InvalidField("tenant", "must not be empty")
    if not is_pseudonym(subject):
        raise InvalidField("subject", "must be a pseudonym (64 hex digits), never a raw user id")
    if _PURPOSE.fullmatch(purpose) is None:
        raise InvalidField("purpose", f"must match {_PURPOSE.pattern}, got {purpose!r}")
    if not policy_version:
        raise InvalidField("policy_version", "must not be empty")
    if not source:
        raise InvalidField("source", "must not be empty")

"""The base-model lease: at most one daemon trains a drafter for a base model at a time.

A lease is a row (name, owner, expiry) in the state database, taken with one conditional UPDATE
(or the INSERT of a new row), which the database applies atomically: a daemon gets it when nobody
holds it, when it already holds it, or when the holder's expiry has passed. The holder renews it
every `ttl_s / 3` from a background thread while it works. A daemon that crashes or is SIGKILLed
stops renewing, so its lease expires after `ttl_s` and the next daemon takes it over: the lock
survives a crash without blocking forever. A live but stalled holder (its thread starved for a
whole ttl) could lose the lease; `Lease.lost` says so and the run stops before it registers
anything.

Not here: what is done under the lease (`daemon/retrain/run.py`).
"""

import logging
import os
import socket
import threading
import time
import uuid
from types import TracebackType
from typing import Self

from sqlalchemy import Column, Engine, Float, MetaData, String, Table, and_, delete, insert, or_, update
from sqlalchemy.exc import IntegrityError

from specloop.daemon.retrain.state_db import create_tables

log = logging.getLogger(__name__)

_metadata = MetaData()
_leases = Table(
    "leases", _metadata,
    Column("name", String, primary_key=True),
    Column("owner", String, nullable=False),
    Column("expires_at", Float, nullable=False),  # time.time() seconds
    Column("acquired_at", Float, nullable=False),
)


def daemon_identity() -> str:
    """Who holds a lease: host, pid and a random part (a restarted daemon may reuse a pid)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaseHeld(RuntimeError):
    """Another live daemon holds the lease."""


class Lease:
    """`with Lease(db, "train:<fingerprint>", owner):` holds the lease, renewed, until the block ends."""

    def __init__(self, db: Engine, name: str, owner: str, ttl_s: float = 60.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        create_tables(_metadata, db)
        self.db, self.name, self.owner, self.ttl_s = db, name, owner, ttl_s
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def try_acquire(self) -> bool:
        """Take the lease if it is free, expired or ours; True when we hold it now."""
        now = time.time()
        with self.db.begin() as conn:
            taken = conn.execute(update(_leases).where(and_(
                _leases.c.name == self.name, or_(_leases.c.owner == self.owner, _leases.c.expires_at < now)))
                .values(owner=self.owner, expires_at=now + self.ttl_s, acquired_at=now)).rowcount
        if taken:
            return True
        try:
            with self.db.begin() as conn:
                conn.execute(insert(_leases).values(name=self.name, owner=self.owner, expires_at=now + self.ttl_s,
                                                    acquired_at=now))
            return True
        except IntegrityError:  # a live holder's row
            return False

    def holder(self) -> tuple[str, float] | None:
        """(owner, seconds until expiry) of the lease's row, or None when nobody ever took it."""
        with self.db.connect() as conn:
            row = conn.execute(_leases.select().where(_leases.c.name == self.name)).first()
        return None if row is None else (row.owner, row.expires_at - time.time())

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self.db.begin() as conn:
            conn.execute(delete(_leases).where(and_(_leases.c.name == self.name, _leases.c.owner == self.owner)))

    def __enter__(self) -> Self:
        if not self.try_acquire():
            held = self.holder()
            who = f"{held[0]}, for {max(0.0, held[1]):.0f} s more unless renewed" if held else "another daemon"
            raise LeaseHeld(f"lease {self.name} is held by {who}")
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name=f"lease-{self.name}", daemon=True)
        self._renewer.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                renewed = self.try_acquire()
            except Exception:  # a database hiccup: the next renewal tries again before expiry
                log.exception("lease %s: renewal failed", self.name)
                continue
            if not renewed:
                self.lost = True
                log.error("lease %s was taken over by another daemon; this run stops", self.name)
                return

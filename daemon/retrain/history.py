"""The promotion history: every promotion, refusal, approval, rejection and rollback, with reasons.

MLflow's registry keeps no alias history (a feature request open since 2019, mlflow#2169), so the
daemon keeps its own, append-only: this module inserts and reads, and has no update or delete.
Each event names the base model, the version it is about, the champion before it (what a rollback
returns to), who acted (the daemon, or a person through `specloop approve`) and why.

Not here: deciding anything (`gate.py`, `rollback.py`), moving aliases (`promotion.py`).
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import Column, DateTime, Engine, Integer, MetaData, String, Table, insert

from specloop.daemon.retrain.state_db import create_tables, newest

_metadata = MetaData()
_events = Table(
    "promotion_history", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("base_model", String, nullable=False),
    Column("action", String, nullable=False),
    Column("version", String, nullable=False),
    Column("previous", String),  # the champion when the event happened
    Column("reason", String, nullable=False),
    Column("actor", String, nullable=False),
    Column("run_id", String),  # the daemon run that produced the version
)


class Action(StrEnum):
    PROMOTED = "promoted"  # `champion` moved to `version`
    AWAITING_APPROVAL = "awaiting_approval"  # passed the gate; `challenger` set, waiting for a person
    APPROVED = "approved"
    REJECTED = "rejected"
    REFUSED = "refused"  # the gate said no
    ROLLED_BACK = "rolled_back"  # `champion` moved from `version` back to `previous`


@dataclass(frozen=True)
class Event:
    at: datetime
    base_model: str
    action: Action
    version: str
    previous: str | None
    reason: str
    actor: str
    run_id: str | None = None


class PromotionHistory:
    def __init__(self, db: Engine) -> None:
        create_tables(_metadata, db)
        self.db = db

    def record(self, base_model: str, action: Action, version: str, reason: str, *, previous: str | None = None,
               actor: str = "daemon", run_id: str | None = None, at: datetime | None = None) -> Event:
        event = Event(at or datetime.now(UTC), base_model, Action(action), version, previous, reason, actor, run_id)
        with self.db.begin() as conn:
            conn.execute(insert(_events).values(
                at=event.at, base_model=base_model, action=event.action.value, version=version, previous=previous,
                reason=reason, actor=actor, run_id=run_id))
        return event

    def events(self, base_model: str | None = None, limit: int | None = None) -> list[Event]:
        """Oldest first; with `limit`, the newest `limit` events."""
        return [Event(_utc(r.at), r.base_model, Action(r.action), r.version, r.previous, r.reason, r.actor, r.run_id)
                for r in newest(self.db, _events, _events.c.id, base_model, limit)]

    def last(self, base_model: str, *actions: Action) -> Event | None:
        found = [e for e in self.events(base_model) if not actions or e.action in actions]
        return found[-1] if found else None


def _utc(at: datetime) -> datetime:
    """SQLite hands back naive datetimes; every time stored here is UTC."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)

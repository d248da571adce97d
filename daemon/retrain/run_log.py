"""The run log: one row per retraining run, updated as it passes each step, so that `specloop
status` shows the last runs and a restarted daemon knows what a killed one left behind.

A run is `started`, then at each step `step` names where it is; it ends as one `RunOutcome`. A row
still `running` when a daemon starts belongs to a daemon that died (the lease says none is alive):
`abandon_unfinished` ends it as `abandoned`. `since` of the last run that trained is where the
trigger counts new traces from.

Not here: doing the steps (`run.py`), the history of aliases (`history.py`).
"""

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import Column, DateTime, Engine, MetaData, String, Table, Text, insert, update

from specloop.daemon.retrain.state_db import create_tables, newest

_metadata = MetaData()
_runs = Table(
    "runs", _metadata,
    Column("run_id", String, primary_key=True),
    Column("base_model", String, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    Column("data_until", DateTime(timezone=True)),  # the newest trace time the run's dataset could hold
    Column("step", String, nullable=False),
    Column("outcome", String, nullable=False),
    Column("detail", Text, nullable=False, default=""),
    Column("version", String),  # the registered version, once there is one
    Column("timings", Text, nullable=False, default="{}"),  # step -> seconds, JSON
)


class RunOutcome(StrEnum):
    RUNNING = "running"
    PROMOTED = "promoted"
    AWAITING_APPROVAL = "awaiting_approval"
    REFUSED = "refused"  # trained and evaluated; the gate kept the champion
    SKIPPED = "skipped"  # no trigger fired, cooldown, or too little data: nothing trained
    FAILED = "failed"  # an error (MLflow down, a bad trace file): retried at the next tick
    ABANDONED = "abandoned"  # stopped by SIGTERM or a crash before it registered anything
    CONSENT_WITHDRAWN = "consent_withdrawn"  # a subject of its dataset withdrew before it registered


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    base_model: str
    started_at: datetime
    finished_at: datetime | None
    data_until: datetime | None
    step: str
    outcome: RunOutcome
    detail: str
    version: str | None
    timings: dict[str, float]


class RunLog:
    def __init__(self, db: Engine) -> None:
        create_tables(_metadata, db)
        self.db = db

    def start(self, run_id: str, base_model: str, data_until: datetime) -> None:
        with self.db.begin() as conn:
            conn.execute(insert(_runs).values(run_id=run_id, base_model=base_model, started_at=datetime.now(UTC),
                                              data_until=data_until, step="start", outcome=RunOutcome.RUNNING.value,
                                              detail="", timings="{}"))

    def step(self, run_id: str, step: str, timings: dict[str, float], version: str | None = None) -> None:
        values = {"step": step, "timings": json.dumps(timings)}
        if version is not None:
            values["version"] = version
        self._update(run_id, **values)

    def finish(self, run_id: str, outcome: RunOutcome, detail: str, timings: dict[str, float]) -> None:
        assert outcome is not RunOutcome.RUNNING
        self._update(run_id, outcome=outcome.value, detail=detail, timings=json.dumps(timings),
                     finished_at=datetime.now(UTC))

    def abandon_unfinished(self, base_model: str, why: str) -> list[RunRecord]:
        """End every run still `running` as abandoned; the runs that were."""
        found = [r for r in self.runs(base_model) if r.outcome is RunOutcome.RUNNING]
        for r in found:
            self.finish(r.run_id, RunOutcome.ABANDONED, f"{why} (it was at step {r.step})", r.timings)
        return found

    def runs(self, base_model: str | None = None, limit: int | None = None) -> list[RunRecord]:
        """Oldest first; with `limit`, the newest `limit` runs."""
        return [_record(r) for r in newest(self.db, _runs, _runs.c.started_at, base_model, limit)]

    def last_trained(self, base_model: str) -> RunRecord | None:
        """The newest run that trained a challenger, whatever the gate said."""
        trained = (RunOutcome.PROMOTED, RunOutcome.AWAITING_APPROVAL, RunOutcome.REFUSED)
        found = [r for r in self.runs(base_model) if r.outcome in trained]
        return found[-1] if found else None

    def _update(self, run_id: str, **values: object) -> None:
        with self.db.begin() as conn:
            assert conn.execute(update(_runs).where(_runs.c.run_id == run_id).values(**values)).rowcount == 1, run_id


def _utc(at: datetime | None) -> datetime | None:
    return at if at is None or at.tzinfo else at.replace(tzinfo=UTC)


def _record(r) -> RunRecord:
    return RunRecord(r.run_id, r.base_model, _utc(r.started_at), _utc(r.finished_at), _utc(r.data_until), r.step,
                     RunOutcome(r.outcome), r.detail, r.version, json.loads(r.timings))

"""The daemon's job store keeps APScheduler's thread alive through a state database that fails for
a moment (a Postgres restart): the stored job runs again after, where APScheduler's own store ended
the thread for good. The outage is injected into the real SQLite database's statements: the ones the
scheduler thread does not guard (next run time, job update) fail while the due-jobs query succeeds,
as when the database goes away between the two (seen on `specloop fleet`)."""

import threading
import time
from pathlib import Path

import pytest
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from specloop.daemon.retrain.job_store import StateJobStore
from specloop.daemon.retrain.state_db import open_state

RUNS: list[float] = []


def count_run() -> None:  # the stored job, named by import path in the store
    RUNS.append(time.monotonic())


def wait_for(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def run_through_an_outage(store_class: type[SQLAlchemyJobStore], tmp_path: Path) -> bool:
    """Whether the stored job ran again once the outage was over."""
    db = open_state(f"sqlite:///{tmp_path / 'state.db'}")
    outage = threading.Event()

    @event.listens_for(db, "before_cursor_execute")
    def fail(conn, cursor, statement, *_) -> None:
        unguarded = statement.startswith(("SELECT apscheduler_jobs.next_run_time", "UPDATE"))
        if outage.is_set() and unguarded:
            raise OperationalError(statement, None, Exception("the database system is shutting down"))

    scheduler = BackgroundScheduler(jobstores={"default": store_class(engine=db), "memory": MemoryJobStore()},
                                    job_defaults={"coalesce": True, "max_instances": 1})
    scheduler.start()
    try:
        scheduler.add_job(count_run, "interval", seconds=0.2, id="stored")
        scheduler.add_job(lambda: None, "interval", seconds=0.2, id="awake", jobstore="memory")
        wait_for(lambda: len(RUNS) >= 2)
        outage.set()
        time.sleep(1.0)
        outage.clear()
        back = time.monotonic()
        deadline = back + 5.0
        while time.monotonic() < deadline and RUNS[-1] <= back:
            time.sleep(0.05)
        return RUNS[-1] > back
    finally:
        scheduler.shutdown(wait=False)


def test_the_scheduler_outlives_a_state_database_outage(tmp_path: Path) -> None:
    assert run_through_an_outage(StateJobStore, tmp_path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_apschedulers_own_store_does_not(tmp_path: Path) -> None:
    """Why the subclass exists: if APScheduler ever guards these calls itself, this fails and it can go."""
    assert not run_through_an_outage(SQLAlchemyJobStore, tmp_path)

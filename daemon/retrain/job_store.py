"""`StateJobStore`: APScheduler 3's SQLAlchemy job store on the state database, kept from ending the
scheduler when that database is away for a moment.

APScheduler's scheduler thread guards only one of the job store calls it makes (`get_due_jobs`). A
database error in the two others, `get_next_run_time` and `update_job`, ends that thread, and with it
every later tick, while the daemon's HTTP side goes on answering /health. Seen on `specloop fleet`:
Postgres restarted in the middle of a run, and one of two daemons never ticked again. Here both
errors are logged instead: without a next run time the scheduler wakes for the in-memory jobs (the
watch, every `watch_s`) and asks again; a tick whose next run time was not stored is due again at
the next look, and runs once (coalesced). Its table is created as the state database's own are, so
that two daemons starting together on a new database both start.

Not here: the scheduler and its jobs (`service.py`), the database (`state_db.py`).
"""

import logging
from datetime import datetime

from apscheduler.job import Job
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from sqlalchemy.exc import SQLAlchemyError

from specloop.daemon.retrain.state_db import created_at_once

log = logging.getLogger(__name__)


class StateJobStore(SQLAlchemyJobStore):
    def start(self, scheduler, alias: str) -> None:  # noqa: ANN001 (APScheduler's types)
        """Its table is created here; two daemons starting together both create it."""
        created_at_once(lambda: super(StateJobStore, self).start(scheduler, alias))

    def get_next_run_time(self) -> datetime | None:
        try:
            return super().get_next_run_time()
        except SQLAlchemyError as e:
            log.warning("job store: state database unavailable (%s); looking again at the next wake-up",
                        type(e).__name__)
            return None

    def update_job(self, job: Job) -> None:
        try:
            super().update_job(job)
        except SQLAlchemyError as e:
            log.warning("job store: %s's next run time not stored (%s); it is due again at the next look",
                        job.id, type(e).__name__)

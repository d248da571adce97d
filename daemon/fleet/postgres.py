"""The fleet's one Postgres server: the daemons' state database and MLflow's backend store.

The server comes from the `pgserver` wheel (PostgreSQL 16 binaries inside a Python package), not the
OS package: it is pinned in the lock like every other dependency, needs no apt and no root, and the
same `make fleet` then runs on any x86-64 Linux machine. It started in 0.65 s here. PostgreSQL
refuses to run as root; under root pgserver runs it as a `pgserver` system user it creates.

It listens on a Unix socket in its data directory only (no TCP port to collide with), so every URL is
`postgresql://postgres:@/<database>?host=<directory>`. `pg_ctl` runs it detached, so it is not a
child of the fleet: `stop()` must run, and a fleet killed outright leaves it running, which the next
start then finds and uses.

Not here: what any database holds (daemon/retrain/state_db.py, MLflow), the other processes
(`topology.py`).
"""

import logging
from pathlib import Path

import sqlalchemy

log = logging.getLogger(__name__)

DATABASES = ("specloop_state", "mlflow")  # the daemons' state; MLflow's registry and runs


class SharedPostgres:
    """`start()`, `url(database)`, `restart()`, `stop()` for the server whose data lives in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self._server = None

    def start(self) -> "SharedPostgres":
        import pgserver  # a second or so to import; only the fleet needs it

        self.directory.mkdir(parents=True, exist_ok=True)
        self._server = pgserver.get_server(self.directory, cleanup_mode="stop")
        for name in DATABASES:
            self._create(name)
        log.info("postgres: PostgreSQL on socket directory %s (pid %s)", self.directory, self.pid)
        return self

    @property
    def pid(self) -> int | None:
        assert self._server is not None, "not started"
        return self._server.get_pid()

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of `database` (psycopg2 over the Unix socket)."""
        assert self._server is not None, "not started"
        assert database in DATABASES, database
        return self._server.get_uri(database)

    def restart(self) -> None:
        """Stop the server (fast shutdown: open connections are cut) and start it again on the same data."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None

    def _create(self, name: str) -> None:
        admin = sqlalchemy.create_engine(self._server.get_uri("postgres"), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                exists = conn.execute(sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
                if exists.first() is None:
                    conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()

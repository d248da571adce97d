"""The daemon's own database: its scheduler's job store, the base-model lease, the run log, the
promotion history and the live-τ samples, each a table owned by its module.

`open_state(url)` returns one SQLAlchemy engine for a URL: a SQLite file on one machine
(`sqlite:////abs/path/state.db`, the embedded default under the data directory), or a shared
database (postgresql://...) when daemons on several machines must see one lease. SQLite runs in
WAL mode with a busy timeout, so the scheduler's thread and the HTTP thread never fail on a lock
the other holds for a moment.

Not here: what any table holds (lease.py, run_log.py, history.py, live_tau.py), MLflow's own database.
"""

from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Column, Engine, MetaData, Row, Table, create_engine, event, select
from sqlalchemy.engine.url import make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

_BUSY_TIMEOUT_MS = 10_000


def open_state(url: str) -> Engine:
    """The engine for `url`; a SQLite file's directory is created."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if parsed.database in (None, "", ":memory:"):
        raise ValueError(f"state database: give a SQLite file (sqlite:////path/state.db), got {url!r}")
    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": _BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(connection, _record) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
    cursor.close()


def create_tables(metadata: MetaData, db: Engine) -> None:
    """`metadata`'s tables, created when missing. Two processes (or threads) opening a new database
    at once both see a table missing and both create it; the loser's "already exists" is success."""
    created_at_once(lambda: metadata.create_all(db))


def created_at_once(create: Callable[[], None]) -> None:
    """Run `create` (a CREATE TABLE when missing), and once more if another process created the
    same table in between: SQLite says so as an OperationalError; Postgres as a unique violation on
    its catalog (two daemons of `specloop fleet` starting together) or a duplicate table."""
    try:
        create()
    except (OperationalError, IntegrityError, ProgrammingError) as e:
        if "already exists" not in str(e):
            raise
        create()  # the other creator may have made only some of the tables


def newest(db: Engine, table: Table, order: Column, base_model: str | None, limit: int | None) -> list[Row]:
    """Rows of `table` (of one base model, or all), the newest `limit` by `order`, oldest first."""
    query = select(table).order_by(order.desc())
    if base_model is not None:
        query = query.where(table.c.base_model == base_model)
    if limit is not None:
        query = query.limit(limit)
    with db.connect() as conn:
        return list(reversed(conn.execute(query).all()))

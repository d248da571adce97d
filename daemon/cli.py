"""The `specloop` console script: one typer app that every package adds its commands to, and the
one logging setup every command runs under.

Each package owns its commands in its own module and exposes `register(app)`; this file only
collects them and configures logging before any command runs (`specloop --log-level debug serve`,
or `SPECLOOP_LOG_LEVEL`). The command modules import their heavy dependencies (torch, FastAPI,
Kafka clients) inside the commands, so `specloop --help` stays fast. Child processes that
`specloop up` starts run this same app (`python -m specloop.daemon.cli sink ...`), so they log the same way.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from specloop.consent import cli as consent_cli
from specloop.daemon import stack
from specloop.daemon.fleet import cli as fleet_cli
from specloop.daemon.retrain import cli as retrain_cli
from specloop.daemon.traffic import sender
from specloop.daemon.training import build_dataset, generate
from specloop.daemon.training import cli as training_cli
from specloop.engine.loaders import cli as loaders_cli
from specloop.engine.server import cli as engine_cli
from specloop.storage import cli as storage_cli

if TYPE_CHECKING:
    from specloop.storage.erasure import ErasureResult

LogLevel = Literal["critical", "error", "warning", "info", "debug"]

app = typer.Typer(no_args_is_help=True, add_completion=False, help="specloop: a speculative-decoding loop.")



def _erase_traces(root: Path, tenant: str, subject: str, work_dir: Path) -> "ErasureResult":
    """storage's Parquet rewrite for `specloop consent revoke --erase`: here, above both consent and
    storage, is where the two meet (imported when used: pyarrow and DuckDB would slow every command)."""
    from specloop.storage.erasure import erase_subject

    return erase_subject(root, tenant, subject, work_dir)


for module in (engine_cli, loaders_cli, generate, training_cli, build_dataset, storage_cli, stack, fleet_cli,
               retrain_cli, sender):
    module.register(app)
consent_cli.register(app, _erase_traces)


@app.callback()
def _root(log_level: Annotated[LogLevel, typer.Option(envvar="SPECLOOP_LOG_LEVEL", help="Log level of every part")]
          = "info") -> None:
    configure_logging(log_level)


# Libraries that log routine work at INFO: kafka-python a dozen lines per producer (re)connect, httpx
# every request (the demo's traffic and the daemon's scrapes), APScheduler every job it runs (the
# daemon's watch, every 15 s), pgserver each pg_ctl call with its whole output (`specloop fleet`).
# They stay at WARNING unless the level is `debug`.
_CHATTY = ("kafka", "httpx", "apscheduler", "pgserver")


def configure_logging(level: LogLevel) -> None:
    """One format on stderr for every command; chatty libraries only when asked for."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else max(logging.WARNING,
                                                                                     logging.getLogger().level))


def main() -> None:
    app()


if __name__ == "__main__":
    main()

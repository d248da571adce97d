"""The `specloop` console script: one typer app that every package adds its commands to.

Each package owns its commands in its own module and exposes `register(app)`; this file only
collects them, so it holds no command logic of its own. The command modules import their heavy
dependencies (torch, FastAPI, Kafka clients) inside the commands, so `specloop --help` stays fast.
"""

import typer

from consent import cli as consent_cli
from daemon import stack
from engine import cli as engine_cli
from engine import drafter_cli, generate_cli
from storage import cli as storage_cli

app = typer.Typer(no_args_is_help=True, add_completion=False, help="specloop: a speculative-decoding loop.")

for module in (engine_cli, generate_cli, drafter_cli, storage_cli, consent_cli, stack):
    module.register(app)


def main() -> None:
    app()

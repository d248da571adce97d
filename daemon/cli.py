"""The `specloop` console script: one typer app that every package adds its commands to.

Each package owns its commands in its own module and exposes `register(app)`; this file only
collects them, so it holds no command logic of its own.
"""

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="specloop: a speculative-decoding loop.")


def _register_all() -> None:
    from engine import cli as engine_cli

    engine_cli.register(app)
    from engine import drafter_cli

    drafter_cli.register(app)
    from storage import cli as storage_cli

    storage_cli.register(app)
    from consent import cli as consent_cli

    consent_cli.register(app)
    from daemon import stack

    stack.register(app)


def main() -> None:
    _register_all()
    app()

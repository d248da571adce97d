"""`specloop fleet`: `Fleet` (topology.py) from the command line, until SIGINT or SIGTERM.

With `--demo` it also sends the demo's consented formal-logic traffic to every engine (one
`specloop replay` per engine) and retrains with the demo policy, so one cycle promotes a drafter
that every engine then serves; without it, the default policy and no traffic.

Not here: the processes themselves (topology.py).
"""

import logging
import signal
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from specloop.daemon.child_command import specloop_command
from specloop.daemon.stack import DEMO_TENANT, POLICIES

log = logging.getLogger(__name__)

_DEMO_USERS_PER_ENGINE = 4
_DEMO_CONCURRENCY_PER_ENGINE = 2


class _Stopped(Exception):
    """A stop signal arrived; the main thread unwinds through the fleet's ordered shutdown."""


def register(app: typer.Typer) -> None:
    app.command("fleet")(fleet)


def fleet(
    root: Annotated[Path, typer.Option(help="Where the fleet keeps Postgres, MLflow, traces, consent and logs")]
    = Path("data/fleet"),
    engines: Annotated[int, typer.Option(help="Engine processes (`specloop serve`)")] = 2,
    sinks: Annotated[int, typer.Option(help="Sink processes in one consumer group (at most 3)")] = 2,
    daemons: Annotated[int, typer.Option(help="Retraining daemons sharing one lease")] = 2,
    model: Annotated[str | None, typer.Option(help="HF model directory or .gguf file (default: SmolLM2 GGUF)")]
    = None,
    demo: Annotated[bool, typer.Option(help="Send consented demo traffic to every engine; demo policy")] = False,
    port: Annotated[int, typer.Option(help="The first engine's port; the others follow; 0 picks free ones")] = 8000,
    daemon_port: Annotated[int, typer.Option(help="The first daemon's port; 0 picks free ones")] = 8100,
    mlflow_port: Annotated[int, typer.Option(help="MLflow's port; 0 picks a free one")] = 5000,
) -> None:
    """Run the production topology as processes on one machine until SIGINT/SIGTERM: Postgres, Kafka
    (tansu), MLflow with its basic-auth app, engines, sinks and daemons."""
    from specloop.daemon.fleet.topology import Fleet, FleetConfig

    try:
        config = FleetConfig(root, engines=engines, sinks=sinks, daemons=daemons, model=model,
                             policy=POLICIES / ("demo.yaml" if demo else "default.yaml"), engine_port=port,
                             daemon_port=daemon_port, mlflow_port=mlflow_port)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if demo:  # a line per request would bury the daemons' progress; /metrics counts requests
        logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _raise_stopped)
    try:
        with Fleet(config) as running:
            if demo:
                _demo_traffic(running)
            log.info("fleet: running; Ctrl-C stops it in order (daemons, engines, sinks, MLflow, broker, Postgres)")
            signal.pause()
    except _Stopped as stopped:
        log.info("%s: stopping the fleet", stopped)


def _demo_traffic(running: "Fleet") -> None:  # noqa: F821 (imported in the command)
    for i, url in enumerate(running.engine_urls, 1):
        command = specloop_command("replay", "--url", url, "--source", "formal-logic", "--api-key",
                                   running.api_key, "--tenant", DEMO_TENANT, "--users", str(_DEMO_USERS_PER_ENGINE),
                                   "--concurrency", str(_DEMO_CONCURRENCY_PER_ENGINE), "--max-tokens", "192",
                                   "--repeat", "--dead-after-s", "600")
        env = {**running.services[f"engine-{i}"].env, "SPECLOOP_ADMIN_TOKEN": running.admin_token}  # grants consents
        running.add_traffic(f"engine-{i}", command, env)


def _raise_stopped(number: int, _: FrameType | None) -> None:
    raise _Stopped(signal.Signals(number).name)

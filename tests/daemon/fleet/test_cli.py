"""`specloop fleet`'s options reach the fleet's configuration field by field, and a count the
topology cannot hold is refused naming the option, before anything starts."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from specloop.daemon.cli import app
from specloop.daemon.fleet import topology
from specloop.daemon.stack import POLICIES


class _Started(Exception):
    pass


def test_options_become_the_configuration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []

    def fleet(config: topology.FleetConfig) -> None:  # stands in for Fleet: nothing starts
        seen.append(config)
        raise _Started

    monkeypatch.setattr(topology, "Fleet", fleet)
    result = CliRunner().invoke(app, ["fleet", "--root", str(tmp_path), "--engines", "3", "--sinks", "1",
                                      "--daemons", "2", "--demo", "--port", "9000", "--daemon-port", "9100",
                                      "--mlflow-port", "0"])
    assert isinstance(result.exception, _Started), result.output
    (config,) = seen
    assert (config.root, config.engines, config.sinks, config.daemons, config.model) == (tmp_path, 3, 1, 2, None)
    assert (config.policy, config.engine_port, config.daemon_port, config.mlflow_port) == (
        POLICIES / "demo.yaml", 9000, 9100, 0)


def test_more_sinks_than_partitions_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fleet", "--root", str(tmp_path), "--sinks", "4"])
    assert result.exit_code == 2 and "sinks must be at most" in result.output


def test_a_port_past_the_last_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["fleet", "--root", str(tmp_path), "--port", "65535", "--engines", "2"])
    assert result.exit_code == 2 and "engine_port must leave every process a port" in result.output

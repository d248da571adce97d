"""The `specloop` root: every package's commands under one app, and the one logging setup."""

import logging
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from specloop.daemon.cli import app, configure_logging


@pytest.fixture
def kafka_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("kafka")
    level = logger.level
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize(("level", "kafka_level"), [("info", logging.WARNING), ("warning", logging.WARNING),
                                                     ("error", logging.ERROR), ("debug", logging.DEBUG)])
def test_kafka_chatter_only_when_asked_for(kafka_logger: logging.Logger, level: str, kafka_level: int) -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(level.upper())  # basicConfig leaves a configured root (pytest's) alone
    try:
        configure_logging(level)
    finally:
        root.setLevel(before)
    assert kafka_logger.level == kafka_level


def test_every_command_is_under_the_root() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    commands = {"serve", "generate", "train-drafter", "eval-drafter", "build-dataset", "sink", "compact", "broker",
                "consent", "up"}
    listed = {line.split()[1] for line in result.output.splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    assert commands <= listed


def test_a_wrong_log_level_is_refused_by_name() -> None:
    result = CliRunner().invoke(app, ["--log-level", "loud", "serve", "--help"])
    assert result.exit_code == 2 and "--log-level" in result.output

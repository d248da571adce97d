"""Training the challenger in several processes: `train-drafter` under torchrun on the tiny 6-layer
Llama gives the run's artifact, and a stop request ends every process of it within seconds."""

import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from specloop.daemon.retrain.challenger import RunStopped, early_stopping_fraction, train_challenger, train_config
from specloop.daemon.retrain.policy import Training
from specloop.daemon.training import cli as training_cli
from specloop.daemon.training.config import TrainConfig
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.speculation.drafter_artifact import read_meta
from specloop.storage.sequences import TokenSequence
from tests.dflash_helpers import greedy_outputs

TRAINING = Training(max_steps=6, batch_size=2, anchors=8, block_size=4)


def test_the_torchrun_child_gets_the_whole_config_from_its_file(tmp_path: Path) -> None:
    cfg = replace(train_config(TRAINING, tmp_path / "out", tmp_path / "champion", seed=7, dtype="bfloat16",
                               train_sequences=1000),
                  num_layers=2, feature_dir=str(tmp_path / "features"), grad_clip=0.5)  # grad_clip: no option
    cfg.write(tmp_path / "config.json")
    parsed = []

    @training_cli._with_config_options
    def probe(out: Annotated[Path | None, typer.Option()] = None,
              config: Annotated[Path | None, typer.Option()] = None, **options: object) -> None:
        parsed.append(training_cli._train_config(out, config, options))

    app = typer.Typer()
    app.command()(probe)
    run = CliRunner().invoke(app, ["--config", str(tmp_path / "config.json")])
    assert run.exit_code == 0, run.output
    assert parsed == [cfg]
    run = CliRunner().invoke(app, ["--config", str(tmp_path / "config.json"), "--lr", "0.1"])
    assert isinstance(run.exception, ValueError) and "leave out --out and ['lr']" in str(run.exception)


def test_a_config_file_with_an_unknown_field_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"out_dir": "x", "learning_rate": 1}')
    with pytest.raises(ValueError, match=r"unknown training config fields \['learning_rate'\]"):
        TrainConfig.read(tmp_path / "config.json")


def test_the_trainer_holds_out_traces_only_where_they_are_enough_to_choose_weights_by() -> None:
    assert early_stopping_fraction(77) == 0.0  # the demo's first run: 5% would have been 1 trace
    assert early_stopping_fraction(399) == 0.0
    assert early_stopping_fraction(400) == 0.05  # 20 held out, the gate's default minimum
    assert early_stopping_fraction(10_000) == 0.05


def answers(loaded: LoadedModel, n: int = 16) -> list[TokenSequence]:
    rng = random.Random(0)
    vocab = loaded.model.config.vocab_size
    prompts = [tuple(rng.randrange(vocab) for _ in range(rng.randrange(6, 14))) for _ in range(n)]
    return greedy_outputs(loaded.model, prompts, max_tokens=24)


@pytest.mark.timeout(300)
def test_two_processes_train_the_challenger(deep_loaded: LoadedModel, tmp_path: Path) -> None:
    data = answers(deep_loaded)
    cfg = train_config(TRAINING, tmp_path / "challenger", None, seed=0, dtype="float32", train_sequences=len(data))
    result = train_challenger(cfg, deep_loaded.model, deep_loaded.fingerprint, data, lambda: None,
                              threading.Event(), processes=2, model_source=deep_loaded.source)
    assert result.artifact == tmp_path / "challenger" and result.steps == 6 and result.stop_reason == "max_steps"
    meta = read_meta(result.artifact)
    assert meta["base_model_fingerprint"] == deep_loaded.fingerprint and meta["lineage"]["steps"] == 6
    # 16 traces are too few for a held-out split of the trainer's own: it trained on all of them.
    assert meta["lineage"]["heldout_sequences"] == 0 and meta["lineage"]["train_sequences"] == 16
    assert result.final_train_loss > 0 and result.train_tokens > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["challenger"]  # the data's scratch directory is gone


def processes_with(text: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `text`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            alive = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and text.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (FileNotFoundError, ProcessLookupError):  # it ended while being read
            continue
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.timeout(300)
def test_a_stop_request_ends_every_process_promptly(deep_loaded: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "challenger"
    cfg = train_config(TRAINING.model_copy(update={"max_steps": 100_000}), out, None, seed=0, dtype="float32",
                       train_sequences=16)
    asked: list[float] = []
    scratch = str(tmp_path / "torchrun-")  # the config file's directory, on every process's command line

    def should_stop() -> str | None:
        # torchrun and both of its processes running: let them train a few seconds, then stop.
        if len(processes_with(scratch)) >= 3 and not asked:
            asked.append(time.monotonic() + 3.0)
        return "lease lost" if asked and time.monotonic() >= asked[0] else None

    with pytest.raises(RunStopped, match="lease lost"):
        train_challenger(cfg, deep_loaded.model, deep_loaded.fingerprint, answers(deep_loaded), should_stop,
                         threading.Event(), processes=2, model_source=deep_loaded.source)
    took = time.monotonic() - asked[0]
    assert took < 10.0, took
    assert not processes_with(scratch)

"""Drafter training under torchrun: two real gloo processes on the CPU train one drafter through
`specloop train-drafter`; without torchrun, one process trains exactly as it did before."""

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specloop.daemon.child_command import SAFE_PATH_ENV
from specloop.daemon.training import distributed
from specloop.daemon.training.checkpoint import CHECKPOINT
from specloop.daemon.training.trainer import Trainer
from specloop.engine.loaders.load import load_model
from specloop.engine.loaders.weight_format import DENSE
from specloop.engine.speculation.drafter_artifact import CONFIG, WEIGHTS, read_meta
from specloop.storage.sequences import write_jsonl
from tests.daemon.training.test_trainer import config, cycling
from tests.dflash_helpers import greedy_outputs, tiny_target

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ["--steps", "12", "--batch-size", "4", "--anchors", "8", "--block-size", "4", "--taps", "3",
         "--max-seq-len", "64", "--lr", "1e-2", "--heldout-fraction", "0.2", "--eval-every", "4", "--no-progress"]


def test_without_torchrun_there_is_one_process_and_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.tensor([1.0, 2.0, 3.0])
    marker = object()
    with distributed.process_group("cpu") as device:
        assert device == "cpu" and not torch.distributed.is_initialized() and not distributed.launched()
        assert (distributed.rank(), distributed.world_size(), distributed.is_main()) == (0, 1, True)
        distributed.barrier()
        assert distributed.from_main(marker) is marker
        assert distributed.sum_over_ranks(1.5, 7) == (1.5, 7)
        distributed.average_gradients([param])
        assert param.grad.tolist() == [1.0, 2.0, 3.0]


def test_one_process_trains_as_before(tmp_path: Path) -> None:
    """The figures of this run as the trainer gave them before it could run under torchrun (and bit
    for bit after, on the machine that recorded them); the tolerance is for other CPUs' rounding."""
    result = Trainer(config(tmp_path, max_steps=12, eval_every=4), tiny_target(), "fp", cycling(20)).run()
    assert result.final_train_loss == pytest.approx(2.2544219493865967, rel=1e-4)
    assert [p["supervised_seen"] for p in result.history] == [374, 741, 1103]
    assert [p["heldout_loss"] for p in result.history] == pytest.approx(
        [2.3515262603759766, 2.298563003540039, 2.2641217708587646], rel=1e-4)


@pytest.fixture(scope="module")
def deep_model(tiny_hf_model: Callable[[str], Path]) -> Path:
    return tiny_hf_model("llama-deep")


@pytest.fixture
def data(deep_model: Path, tmp_path: Path) -> Path:
    """The tiny model's greedy answers to 24 random prompts, as JSONL."""
    loaded = load_model(deep_model, torch.float32, torch.device("cpu"))
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(loaded.model.config.vocab_size) for _ in range(rng.randrange(6, 14)))
               for _ in range(24)]
    write_jsonl(tmp_path / "data.jsonl", greedy_outputs(loaded.model, prompts, max_tokens=24))
    return tmp_path / "data.jsonl"


def train_drafter(launcher: list[str], data: Path, model: Path, out: Path) -> subprocess.CompletedProcess:
    # One thread per process, as torchrun sets for several: the single-process run then matches
    # this test process's own (conftest's torch.set_num_threads(1)) bit for bit.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **SAFE_PATH_ENV}
    command = [*launcher, "-m", "specloop.daemon.cli", "train-drafter", "--data", str(data), "--out", str(out),
               "--model", str(model), *TRAIN]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
                          check=False)


@pytest.mark.timeout(300)
def test_two_processes_train_one_drafter(data: Path, deep_model: Path, tmp_path: Path) -> None:
    run = train_drafter([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
                        data, deep_model, tmp_path / "ddp")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)  # the main process's result only
    assert result["steps"] == 12 and result["stop_reason"] == "max_steps"
    # Both processes stopped at the same step; the artifact was written once, by rank 0.
    assert "process 0 of 2: stopped at step 12" in run.stderr and "process 1 of 2: stopped at step 12" in run.stderr
    written = [line for line in run.stderr.splitlines() if "wrote the drafter artifact" in line]
    assert len(written) == 1 and "process 0 of 2" in written[0], written
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [CHECKPOINT, CONFIG, WEIGHTS]
    assert read_meta(tmp_path / "ddp")["lineage"]["steps"] == 12
    losses = [p["heldout_loss"] for p in result["history"]]
    assert [p["step"] for p in result["history"]] == [4, 8, 12] and losses[-1] < losses[0], losses


@pytest.mark.timeout(300)
def test_one_process_without_torchrun_is_the_trainers_own_run(data: Path, deep_model: Path, tmp_path: Path) -> None:
    from specloop.daemon.training import cli as training_cli
    from specloop.daemon.training.config import TrainConfig
    from specloop.storage.sequences import read_sequences

    run = train_drafter([sys.executable], data, deep_model, tmp_path / "cli")
    assert run.returncode == 0, run.stderr
    assert "process 0 of 1: stopped at step 12" in run.stderr
    loaded = training_cli._target(str(deep_model), "float32", "cpu", DENSE)
    cfg = TrainConfig(out_dir=str(tmp_path / "lib"), max_steps=12, batch_size=4, num_anchors=8, block_size=4,
                      num_taps=3, max_seq_len=64, lr=1e-2, heldout_fraction=0.2, eval_every=4, progress=False)
    Trainer(cfg, loaded.model, loaded.fingerprint, read_sequences([data])).run()
    cli, lib = (load_file(tmp_path / name / WEIGHTS) for name in ("cli", "lib"))
    assert cli.keys() == lib.keys() and all(torch.equal(cli[k], lib[k]) for k in cli)

"""`specloop train-drafter` and `eval-drafter` end to end: on the real SmolLM2 (a few steps, a few
tokens), and on a tiny model's NVFP4 target warm-started from its dense model's drafter."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from specloop.daemon.cli import app as specloop
from specloop.daemon.training import cli as training_cli
from specloop.engine.loaders.load import LoadedModel, load_model
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.speculation.drafter_artifact import read_meta
from specloop.storage.sequences import TokenSequence, write_jsonl

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def app(smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> typer.Typer:
    # The commands load the real model themselves; reuse the session's copy instead of reloading it.
    monkeypatch.setattr(training_cli, "_target", lambda model, dtype, device, weights: smollm2)
    app = typer.Typer()
    training_cli.register(app)
    return app


@pytest.mark.integration
def test_train_then_eval_on_smollm2(app: typer.Typer, smollm2: LoadedModel, tmp_path: Path) -> None:
    tok = smollm2.tokenizer
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(3):\n    print(i)\n", "x = [1, 2, 3]\ny = x\n"]
    prompt = tuple(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write Python."}])))
    write_jsonl(tmp_path / "d.jsonl", [TokenSequence(prompt, tuple(tok.encode(t))) for t in texts])
    out = tmp_path / "drafter"
    run = CliRunner().invoke(app, ["train-drafter", "--data", str(tmp_path / "d.jsonl"), "--out", str(out),
                                   "--steps", "2", "--block-size", "4", "--anchors", "4", "--heldout-fraction", "0",
                                   "--trim-vocab", "--no-progress", "--feature-dir", str(tmp_path / "features"),
                                   "--feature-dir-gb", "1"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.output)
    assert result["steps"] == 2 and result["features"]["evicted_from_disk"] == 0
    assert result["features"]["computed"] == len(list((tmp_path / "features").glob("*.safetensors"))) == 3
    assert read_meta(out)["base_model_fingerprint"] == smollm2.fingerprint
    run = CliRunner().invoke(app, ["eval-drafter", "--data", str(tmp_path / "d.jsonl"), "--drafter", str(out),
                                   "--output", str(tmp_path / "eval.json")])
    assert run.exit_code == 0, run.output
    report = json.loads((tmp_path / "eval.json").read_text())
    assert [r["kind"] for r in report["results"]] == ["ngram", "suffix", "dflash", "combined", "dflash+suffix"]
    assert all(1.0 <= r["tau"] <= 4.0 for r in report["results"])
    assert report["set"]["sequences"] == 3


@pytest.mark.integration
def test_eval_refuses_a_drafter_for_another_model(app: typer.Typer, smollm2: LoadedModel, tmp_path: Path) -> None:
    from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
    from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter

    save_drafter(tmp_path / "other", DFlashDrafter(DFlashConfig.for_target(smollm2.model.config, block_size=4)),
                 "0000000000000000", Lineage("d", 0, 0))
    write_jsonl(tmp_path / "d.jsonl", [TokenSequence((1, 2), (3, 4))])
    run = CliRunner().invoke(app, ["eval-drafter", "--data", str(tmp_path / "d.jsonl"), "--drafter",
                                   str(tmp_path / "other")])
    assert run.exit_code == 2 and "trained for base model 0000000000000000" in run.output


def test_an_nvfp4_target_trains_its_own_drafter_warm_started_from_the_dense_ones(
        tiny_hf_model: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_hf_model("llama-deep")
    write_jsonl(tmp_path / "d.jsonl", [TokenSequence((1, 2, 3), tuple(range(10 + i, 22 + i))) for i in range(3)])
    data = ["--data", str(tmp_path / "d.jsonl"), "--model", str(model)]
    train = ["train-drafter", *data, "--steps", "2", "--block-size", "4", "--anchors", "4", "--taps", "2",
             "--heldout-fraction", "0", "--no-progress"]
    run = CliRunner().invoke(specloop, [*train, "--out", str(tmp_path / "dense")])
    assert run.exit_code == 0, run.output
    nvfp4_target = ["--weights", "nvfp4", "--nvfp4-embedding"]  # the drafter embeds its blocks by NVFP4 lookup
    run = CliRunner().invoke(specloop, [*train, "--out", str(tmp_path / "nvfp4"), *nvfp4_target,
                                        "--init-from", str(tmp_path / "dense")])
    assert run.exit_code == 0, run.output
    dense, nvfp4 = read_meta(tmp_path / "dense"), read_meta(tmp_path / "nvfp4")
    fmt = WeightFormat("nvfp4", embedding=True)
    fingerprint = load_model(model, torch.float32, torch.device("cpu"), fmt).fingerprint
    assert nvfp4["base_model_fingerprint"] == fingerprint != dense["base_model_fingerprint"]
    assert nvfp4["lineage"]["warm_start_base_model"] == dense["base_model_fingerprint"]
    # From scratch too: the new drafter's mask embedding starts as the NVFP4 embedding's mean row.
    run = CliRunner().invoke(specloop, [*train, "--out", str(tmp_path / "scratch"), *nvfp4_target])
    assert run.exit_code == 0, run.output
    assert read_meta(tmp_path / "scratch")["base_model_fingerprint"] == fingerprint
    evaluate = ["eval-drafter", *data, *nvfp4_target, "--no-ngram", "--no-combined", "--drafter"]
    run = CliRunner().invoke(specloop, [*evaluate, str(tmp_path / "nvfp4")])
    assert run.exit_code == 0, run.output
    assert json.loads(run.output)["base_model_fingerprint"] == fingerprint
    run = CliRunner().invoke(specloop, [*evaluate, str(tmp_path / "dense")])
    assert run.exit_code == 2 and f"trained for base model {dense['base_model_fingerprint']}" in run.output

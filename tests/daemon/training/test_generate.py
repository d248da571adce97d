"""`specloop generate` end to end on a tiny model: real HumanEval prompts, the engine, the split."""

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from specloop.daemon.cli import app
from specloop.engine.loaders.load import load_model
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.storage.sequences import read_sequences


def test_generate_writes_a_disjoint_train_and_heldout_split(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, prompts = tmp_path / "boot", tmp_path / "prompts.jsonl"
    words = ["fox", "dog", "code", "print", "add", "tabs", "text", "model", "serve", "draft", "quick", "lazy", "cafe"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w} twice"}]}) + "\n"
                               for w in words))
    result = CliRunner().invoke(app, ["generate", "--out", str(out), "--model", str(tiny_llama_dir),
                                      "--source", "file", "--prompts-file", str(prompts), "--limit", "12",
                                      "--max-tokens", "6", "--concurrency", "4", "--dtype", "float32",
                                      "--heldout-fraction", "0.3"])
    assert result.exit_code == 0, result.output
    stats = json.loads((out / "stats.json").read_text())
    train, held = read_sequences([out / "train.jsonl"]), read_sequences([out / "heldout.jsonl"])
    assert stats["prompts"] == 12 == len(train) + len(held) and held and train
    assert {s.prompt for s in train}.isdisjoint({s.prompt for s in held})
    assert all(1 <= len(s.response) <= 6 for s in train + held)
    assert stats["response_tokens"] == sum(len(s.response) for s in train + held)


def test_generate_resume_answers_only_the_missing_prompts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out, prompts = tmp_path / "boot", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}"}]}) + "\n"
                               for i in range(10)))
    base = ["generate", "--out", str(out), "--model", str(tiny_llama_dir), "--source", "file", "--prompts-file",
            str(prompts), "--max-tokens", "4", "--concurrency", "3", "--chunk", "2", "--dtype", "float32"]
    first = CliRunner().invoke(app, [*base, "--limit", "4"])
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(app, [*base, "--limit", "10", "--resume"])
    assert second.exit_code == 0, second.output
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["skipped_already_answered"], stats["prompts"]) == (4, 6)
    rows = read_sequences([out / "train.jsonl", out / "heldout.jsonl"])
    assert len(rows) == 10 == len({r.prompt for r in rows})


def test_generate_skips_prompts_an_earlier_round_answered(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Name {i}"}]}) + "\n"
                               for i in range(7)))
    base = ["--model", str(tiny_llama_dir), "--source", "file", "--prompts-file", str(prompts), "--max-tokens", "3",
            "--concurrency", "3", "--dtype", "float32"]
    first = CliRunner().invoke(app, ["generate", "--out", str(tmp_path / "r1"), *base, "--limit", "3"])
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(app, ["generate", "--out", str(tmp_path / "r2"), *base,
                                      "--skip-answered-in", str(tmp_path / "r1" / "train.jsonl"),
                                      "--skip-answered-in", str(tmp_path / "r1" / "heldout.jsonl")])
    assert second.exit_code == 0, second.output
    stats = json.loads((tmp_path / "r2" / "stats.json").read_text())
    assert (stats["skipped_already_answered"], stats["prompts"]) == (3, 4)
    old, new = (read_sequences([tmp_path / r / "train.jsonl", tmp_path / r / "heldout.jsonl"]) for r in ("r1", "r2"))
    assert len(old) == 3 and {s.prompt for s in old}.isdisjoint({s.prompt for s in new})


def test_generate_answers_with_the_nvfp4_target(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i}"}]}) + "\n"
                               for i in range(3)))
    base = ["generate", "--model", str(tiny_llama_dir), "--source", "file", "--prompts-file", str(prompts),
            "--max-tokens", "3", "--concurrency", "3", "--dtype", "float32", "--weights", "nvfp4"]
    result = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "q"), "--nvfp4-lm-head"])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "q" / "stats.json").read_text())
    dense = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    nvfp4 = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), WeightFormat("nvfp4", lm_head=True))
    assert (stats["weights"], stats["nvfp4_lm_head"], stats["nvfp4_embedding"]) == ("nvfp4", True, False)
    assert (stats["base_model"], stats["source_base_model"]) == (nvfp4.fingerprint, dense.fingerprint)
    assert nvfp4.fingerprint != dense.fingerprint


def test_generate_refuses_bad_options(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["generate", "--out", str(tmp_path), "--dtype", "float16"])
    assert result.exit_code != 0 and "--dtype" in result.output
    for flag in ("--nvfp4-lm-head", "--nvfp4-embedding"):
        result = CliRunner().invoke(app, ["generate", "--out", str(tmp_path), flag])
        assert result.exit_code == 2 and "needs weights='nvfp4'" in " ".join(result.output.replace("│", " ").split())
    result = CliRunner().invoke(app, ["generate", "--out", str(tmp_path), "--skip-answered-in", str(tmp_path / "no.jsonl")])
    words = " ".join(result.output.replace("│", " ").split())  # the error box wraps lines
    assert result.exit_code == 2 and "--skip-answered-in: training data" in words and "does not exist" in words

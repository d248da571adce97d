"""A model as read from disk, before it becomes a `Transformer`: the common output of every loader.

Both loaders (`hf.py` for Hugging Face directories, `gguf.py` for GGUF files) produce one, so that
`load.py` builds the model the same way whatever the file format. It is not a model: the
weights are plain tensors with Hugging Face names, in the dtype the file stored (float32 after GGUF
dequantization).

An NVFP4 model (an NVFP4 checkpoint, or a dense model quantized on load) is one too, built by
`nvfp4_stored_model`: `weights` holds every tensor densely (the quantized ones dequantized to
float32), so whatever reads dense weights keeps working, and `nvfp4` holds the exact NVFP4 weights.
"""

from dataclasses import dataclass

import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.fingerprint import base_model_fingerprint, nvfp4_weights_digest
from specloop.engine.model.tokenizer import Tokenizer
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize


@dataclass(frozen=True)
class StoredModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, e.g. `model.layers.0.self_attn.q_proj.weight`
    tokenizer: Tokenizer
    weights_digest: str  # sha256 hex of the tensors as stored in the file (see `engine/model/fingerprint.py`)
    name: str  # the served model id, e.g. `SmolLM2-135M-Instruct`
    nvfp4: dict[str, NVFP4Weight] | None = None  # the NVFP4 weights by Hugging Face name; None for a dense model
    source_fingerprint: str | None = None  # of the model this one was quantized from, when known

    def __post_init__(self) -> None:
        assert self.nvfp4 is None or self.nvfp4.keys() <= self.weights.keys(), "NVFP4 weights without a dense copy"

    @property
    def fingerprint(self) -> str:
        """The base-model fingerprint (`engine/model/fingerprint.py`)."""
        return base_model_fingerprint(self.weights_digest, self.config, self.tokenizer)


def nvfp4_stored_model(config: ModelConfig, dense: dict[str, torch.Tensor], quantized: dict[str, NVFP4Weight],
                       tokenizer: Tokenizer, name: str, source_fingerprint: str | None) -> StoredModel:
    """An NVFP4 model of `quantized` weights and `dense` others (norms, embedding, biases, unquantized
    projections), hashed canonically so that every way of arriving at the same weights agrees."""
    weights = {**dense, **{n: dequantize(q) for n, q in quantized.items()}}
    return StoredModel(config, weights, tokenizer, nvfp4_weights_digest(dense, quantized), name, quantized,
                       source_fingerprint)

"""A model as read from disk, before it becomes a `Transformer`: the common output of every loader.

Both loaders (`hf.py` for Hugging Face directories, `gguf.py` for GGUF files) produce one, so that
`load.py` builds the model the same way whatever the file format. It is not a model: the
weights are plain tensors with Hugging Face names, in the dtype the file stored (float32 after GGUF
dequantization).
"""

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class StoredModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, e.g. `model.layers.0.self_attn.q_proj.weight`
    tokenizer: Tokenizer
    weights_digest: str  # sha256 hex of the tensors as stored in the file (see `engine/model/fingerprint.py`)
    name: str  # the served model id, e.g. `SmolLM2-135M-Instruct`

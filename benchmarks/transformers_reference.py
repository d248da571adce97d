"""A transformers `LlamaForCausalLM` holding a checkpoint's weights: the reference we compare against.

Tests and benchmarks check our engine against transformers on exactly the same numbers. Building
the reference from our own `StoredModel` takes a second, where transformers' GGUF loader needs about
30 s here for SmolLM2. The GGUF reader itself is checked against that loader elsewhere
(`tests/engine/model/test_transformer.py`).

transformers is a test dependency only; nothing that serves imports this file.
"""

import torch

from specloop.engine.loaders.stored_model import StoredModel


def transformers_llama(stored: StoredModel, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = stored.config
    if c.arch != "llama" or c.rope_scaling is not None:
        raise ValueError(f"only plain Llama checkpoints have a reference here, got {c.arch} "
                         f"with rope_scaling {c.rope_scaling}")
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                         num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                         max_position_embeddings=c.max_position, rms_norm_eps=c.rms_norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                         tie_word_embeddings=c.tie_word_embeddings)
    model = LlamaForCausalLM(config)
    # A tied checkpoint has no `lm_head.weight`; the tie fills it.
    model.load_state_dict(stored.weights, strict=not c.tie_word_embeddings)
    return model.to(device=device, dtype=dtype).eval()

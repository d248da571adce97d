"""`apply_nvfp4`: which modules become NVFP4, what they compute eagerly (the dequantized weight,
exactly), and what it refuses."""

import pytest
import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.nvfp4_linear import _TRITON_ROWS, Nvfp4Linear, apply_nvfp4, linear_modules
from specloop.engine.model.transformer import Transformer
from specloop.kernels.nvfp4 import dequantize, quantize

CONFIG = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position=64, tie_word_embeddings=True)


def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).eval().requires_grad_(False)


def test_named_modules_become_nvfp4_and_compute_from_the_dequantized_weight() -> None:
    dense, nvfp4 = model(), model()
    weights = {name: quantize(m.weight) for name, m in linear_modules(nvfp4).items() if name != "lm_head"}
    apply_nvfp4(nvfp4, weights)
    assert sorted(linear_modules(nvfp4)) == ["lm_head"]  # the head stays dense, and tied to the embedding
    assert nvfp4.lm_head.weight is nvfp4.embed.weight
    for name, q in weights.items():
        layer = nvfp4.get_submodule(name)
        assert isinstance(layer, Nvfp4Linear) and torch.equal(layer.weight, dequantize(q))
        dense.get_submodule(name).weight.copy_(dequantize(q))
    tokens = torch.randint(0, 64, (2, 9))
    assert torch.equal(nvfp4.logits(nvfp4(tokens)[0]), dense.logits(dense(tokens)[0]))


def test_the_head_of_a_tied_model_can_be_nvfp4_while_the_embedding_stays_dense() -> None:
    m = model()
    embedding = m.embed.weight.clone()
    apply_nvfp4(m, {"lm_head": quantize(m.lm_head.weight)})
    assert isinstance(m.lm_head, Nvfp4Linear) and torch.equal(m.embed.weight, embedding)


def test_refuses_unknown_modules_and_wrong_shapes() -> None:
    m = model()
    with pytest.raises(ValueError, match="does not have"):
        apply_nvfp4(m, {"layers.9.attn.qkv": quantize(torch.randn(128, 64))})
    with pytest.raises(ValueError, match="does not match"):
        apply_nvfp4(m, {"layers.0.attn.o": quantize(torch.randn(64, 32))})


def test_the_gpu_row_limit_is_the_triton_kernels() -> None:
    from specloop.kernels.nvfp4_triton import MAX_ROWS

    assert _TRITON_ROWS == MAX_ROWS

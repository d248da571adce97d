"""`Nvfp4Embedding`: a lookup returns exactly the dequantized rows, in the model's dtype, for ids of
any shape; a model with one computes what the same model with those rows densely computes; `apply_nvfp4`
puts it in place of `embed` and refuses a matrix of the wrong shape."""

import pytest
import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.nvfp4_embedding import Nvfp4Embedding
from specloop.engine.model.nvfp4_linear import apply_nvfp4
from specloop.engine.model.transformer import Transformer
from specloop.kernels.nvfp4 import dequantize, quantize

CONFIG = ModelConfig(arch="llama", vocab_size=80, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position=64)


def model(dtype: torch.dtype = torch.float32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG).to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lookup_is_the_dequantized_rows(dtype: torch.dtype) -> None:
    q = quantize(torch.randn(80, 64, generator=torch.Generator().manual_seed(1)))
    table = dequantize(q).to(dtype)  # [80, 64]
    embedding = Nvfp4Embedding(q, dtype)
    assert not list(embedding.parameters()) and not list(embedding.buffers())  # the 4-bit form only
    for ids in (torch.tensor(7), torch.tensor([3, 3, 79]), torch.randint(0, 80, (2, 3, 5))):
        out = embedding(ids)
        assert out.shape == (*ids.shape, 64) and out.dtype == dtype
        assert torch.equal(out, table[ids])
    assert torch.equal(embedding.weight, table)


def test_a_model_with_an_nvfp4_embedding_computes_as_with_its_rows_dense() -> None:
    nvfp4, dense = model(), model()
    q = quantize(nvfp4.embed.weight)
    apply_nvfp4(nvfp4, {"embed": q})
    assert isinstance(nvfp4.embed, Nvfp4Embedding)
    assert (nvfp4.device, nvfp4.dtype) == (torch.device("cpu"), torch.float32)  # read without a dense embedding
    dense.embed.weight.copy_(dequantize(q))
    tokens = torch.randint(0, 80, (2, 9))
    assert torch.equal(nvfp4.logits(nvfp4(tokens)[0]), dense.logits(dense(tokens)[0]))


def test_a_matrix_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"embed: NVFP4 weight \(64, 64\) does not match the module's \(80, 64\)"):
        apply_nvfp4(model(), {"embed": quantize(torch.randn(64, 64))})

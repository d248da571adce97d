"""NVFP4 linear layers in a `Transformer`: the module that serves a weight from its NVFP4 form.

`apply_nvfp4(model, weights)` replaces the named `nn.Linear` modules of a model (module paths as
`Transformer.named_modules` gives them: `layers.0.attn.qkv`, `layers.0.mlp.gate_up`, `lm_head`, ...)
by `Nvfp4Linear`s built from their NVFP4 weights, and a named `nn.Embedding` (`embed`) by an
`Nvfp4Embedding` (`nvfp4_embedding.py`). A fused module (qkv, gate_up) is one NVFP4 tensor with one
tensor scale, as vLLM requires of the layers it fuses.

`Nvfp4Linear` keeps the NVFP4 weight (what the kernels read) and its dequantization in the model's
dtype (what passes of many rows read: prefill chunks, where a dense GEMM reuses every weight across
rows). The dequantized copy costs the memory of a dense model, on purpose: on the CPU the 4-bit
form is for speed of decode, where each step streams every weight once, not for memory. Where
rows are few, the Triton kernel (`kernels/nvfp4_triton.py`, on CUDA GPUs, up to its 64 rows) or,
once `engine/cpu/linear.py` has swapped this module for its CPU form, the C++ kernel computes from
the 4-bit form.

This file is not the format (`kernels/nvfp4.py`), not checkpoint I/O (`engine/loaders/`) and not the
kernels; it decides which of them a pass uses.
"""

import torch
import torch.nn.functional as F
from torch import nn

from specloop.engine.model.nvfp4_embedding import Nvfp4Embedding
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize

_TRITON_ROWS = 64  # kernels/nvfp4_triton.py's MAX_ROWS, without importing triton on CPU-only machines


class Nvfp4Linear(nn.Module):
    """A frozen linear layer whose weight is NVFP4; `weight` is its dequantization `[out, in]`."""

    def __init__(self, q: NVFP4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.q = q
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", dequantize(q).to(dtype), persistent=False)  # [out, in]
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.numel() // x.shape[-1] <= _TRITON_ROWS:
            from specloop.kernels.nvfp4_triton import nvfp4_linear  # triton loads only where it runs

            return nvfp4_linear(x, self.q, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's `nn.Linear` modules by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def quantizable_modules(model: nn.Module) -> dict[str, nn.Linear | nn.Embedding]:
    """The model's `nn.Linear` and `nn.Embedding` modules by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)}


def apply_nvfp4(model: nn.Module, weights: dict[str, NVFP4Weight]) -> None:
    """Replace each named linear or embedding module by its NVFP4 form, in place."""
    modules = quantizable_modules(model)
    unknown = sorted(set(weights) - set(modules))
    if unknown:
        raise ValueError(f"NVFP4 weights for modules the model does not have: {unknown[:5]}")
    for name, q in weights.items():
        old = modules[name]
        if q.shape != tuple(old.weight.shape):
            raise ValueError(f"{name}: NVFP4 weight {q.shape} does not match the module's {tuple(old.weight.shape)}")
        device, dtype = old.weight.device, old.weight.dtype
        q = NVFP4Weight(q.packed.to(device), q.block_scale.to(device), q.tensor_scale.to(device))
        new = Nvfp4Embedding(q, dtype) if isinstance(old, nn.Embedding) else Nvfp4Linear(q, old.bias, dtype)
        model.set_submodule(name, new)

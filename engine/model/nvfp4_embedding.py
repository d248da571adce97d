"""An NVFP4 token embedding: the lookup that gathers a token's row of 4-bit codes and block scales
and dequantizes just those rows.

Unlike `Nvfp4Linear` it keeps no dense copy: a lookup reads one row per token, so dequantizing on
the fly costs nothing measurable, and the point of an NVFP4 embedding is its memory (SmolLM2's
49,152 x 576 matrix: 56.6 MB in bf16, 15.9 MB in NVFP4). `apply_nvfp4`
(`engine/model/nvfp4_linear.py`) puts it in place of a model's `nn.Embedding`.

Not here: the format (`kernels/nvfp4.py`) or choosing to quantize (`engine/loaders/`).
"""

import torch
from torch import nn

from specloop.kernels.nvfp4 import BLOCK, NVFP4Weight, dequantize


class Nvfp4Embedding(nn.Module):
    """A frozen embedding `[vocab, hidden]` held as NVFP4, returning rows in `dtype`."""

    def __init__(self, q: NVFP4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.q = q
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[...]` → embeddings `[..., hidden]`."""
        flat = ids.reshape(-1)
        rows = NVFP4Weight(self.q.packed[flat], self.q.block_scale[flat], self.q.tensor_scale)
        out = dequantize(rows).to(self.dtype)  # [n, hidden]
        assert out.shape == (flat.numel(), self.embedding_dim)
        return out.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole matrix dequantized `[vocab, hidden]`, made on each read: for one-off readers only
        (a drafter's initialization takes its mean), as `nn.Embedding.weight` is read."""
        return dequantize(self.q).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nvfp4 (blocks of {BLOCK})"

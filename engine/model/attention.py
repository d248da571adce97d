"""Scaled-dot-product attention as every model here calls it, with the CPU's slow bf16 path avoided.

On this CPU (torch 2.13, 2 cores, SmolLM2 shapes: 9 query heads, 3 KV heads, head dim 64) the
bf16 SDPA kernels are far slower than fp32 ones, measured per call:

    one-token decode, batch 1, 200 keys:    bf16 0.20 ms   fp32 0.02 ms
    one-token decode, batch 32, 550 keys:   bf16 16.0 ms   fp32 2.4 ms
    512-token causal prefill:               bf16 7.3 ms    fp32 6.2 ms

so on the CPU attention runs in fp32 whatever the model's dtype, and the KV cache is kept in fp32
there (46 KB per token for SmolLM2) so decode never upcasts the whole context. On CUDA both follow
the model's dtype. This file is only that policy and the call; masks and caches are built elsewhere.
"""

import torch
import torch.nn.functional as F


def cache_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype keys and values are stored and attended in on `device`."""
    return torch.float32 if device.type == "cpu" else model_dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """q `[B, Hq, n, D]`, k/v `[B, Hkv, T, D]` (Hq a multiple of Hkv), mask `[B, 1, n, T]` bool (True =
    see) or None → `[B, Hq, n, D]` in q's dtype."""
    assert mask is None or not causal, "pass a mask or causal, not both"
    dtype = cache_dtype(q.dtype, q.device)
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask, is_causal=causal,
                                         enable_gqa=True)
    return out.to(q.dtype)

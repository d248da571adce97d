"""Inference-only linear layers tuned for the CPU's matrix kernels; on other devices nothing changes.

Measured here (2 cores, GB/s of weights streamed). fp32 on the 576 → 49152 LM head, best of 3:

| dtype | rows | `F.linear` | `x @ W.T` (W.T contiguous) | oneDNN prepacked |
| --- | --- | --- | --- | --- |
| fp32 | 1 | 11.4 | 23.7 | 9.0 |
| fp32 | 8 | 5.2 | 4.9 | 6.6 |

bf16 on forty 576 → 3072 matrices (140 MB, so nothing stays in cache), idle machine: `F.linear`
11.8 at one row; prepacked 19.6 at one row, 18.6 at two, 15.7 at eight (`F.linear` at eight rows:
3.8 on the LM head). So bf16 runs prepacked, and fp32 keeps the transposed weight where the C++
kernels do not build.

Passes of at most `SMALL_ROWS` rows go to the C++ kernel in `kernels/cpu_decode.cpp`: weights packed
in 4-row tiles, one sequential read each. On the LM head in bf16 (AVX-512 BF16): 1.9 ms at one row
and 2.2 at eight, against 2.3 and 2.4 for oneDNN prepacked. Larger passes use oneDNN (bf16) or
`F.linear` (fp32).

Where oneDNN has no native bf16 dot products (`kernels/cpu_features.py`: AVX2-only CPUs, where its
bf16 path refuses to run, and AVX-512 CPUs without BF16, where it emulates them) bf16 weights stay
bf16 and are computed in fp32: the kernel widens them up to `WIDENED_ROWS` rows, and larger passes
widen the whole weight for one fp32 `F.linear`. Measured on a Xeon Ice Lake with the AVX2 build
(ms, 576 → 3072 | LM head):

| rows | kernel | widen + fp32 `F.linear` | bf16 `F.linear` |
| --- | --- | --- | --- |
| 1 | 0.07 / 2.63 | 0.39 / 30.3 | 0.15 / 3.59 |
| 8 | 0.29 / 5.93 | 0.63 / 40.1 | 1.00 / 16.8 |
| 32 | 1.31 / 23.0 | 1.96 / 49.2 | 4.13 / 65.4 |
| 64 | 2.66 / 47.9 | 1.55 / 47.5 | 8.27 / 138 |
| 512 | | 6.8 / 159 | 75.5 / 1269 |

and on the same CPU unforced, oneDNN's emulated bf16 at 512 rows took 30.6 ms on 576 → 3072.

NVFP4 layers (`engine/model/nvfp4_linear.py`) become `CpuNvfp4Linear`s: passes of up to `FP4_ROWS`
rows go to the kernel's NVFP4 tiles (4.5 bits per weight, int8 activations); larger ones (prefill
chunks) to a `CpuLinear` of the dequantized weight. Measured on a Xeon Ice Lake (AVX2 build, 2
threads, the 120 layer matrices of SmolLM2 shaped as random weights): 4.2 ms at one row against 13.4
ms for the bf16 kernel, 9.4 against 16.0 at four rows, 17.9 against 33.1 at eight; on one thread both
stream about 8 GB/s at one row, so one row is bound by memory and more rows by the per-row integer
work. `FP4_ROWS` is every pass the fused decoder takes, not where the kernel stops winning: the two
paths round differently, so a token's logits would depend on how many rows shared its pass, and
greedy speculation would stop being token-identical to plain decoding. It was 16, and an NVFP4 LM
head (SmolLM2, AMX Xeon) answered 8 concurrent requests with drafts differently from plain decoding
(`benchmarks/first_drafter.py`, run 1), since a verify pass of 8 × 4 rows read the dense head. That
exactness costs time on wide passes: the LM head took 10.7 ms at 32 rows in the kernel against 2.5
dense, 5.3 against 1.8 at 16 and 2.6 against 3.3 at 8 (`benchmarks/first_drafter.py`'s CPU); the
engine's width rule sees it in its measured pass cost (`engine/runtime/verify_cost.py`).

These layers have no autograd: training code must use the plain `nn.Linear` model.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from specloop.engine.cpu.fused_decode import FP4_CHUNK, MAX_DECODE_ROWS, attach
from specloop.engine.model.nvfp4_linear import Nvfp4Linear
from specloop.engine.model.transformer import Transformer
from specloop.kernels.cpu_decode import cpu_plan, load

# Rows up to which the C++ kernel beats prepacked oneDNN on its own (bf16 LM head: 2.2 vs 2.4 ms at
# 8 rows, 4.8 vs 3.3 at 16). Inside the fused pass, with no glue ops, it wins up to 16 rows.
SMALL_ROWS = 8
# Rows up to which the kernel beats widening a bf16 weight for fp32 `F.linear` (table above).
WIDENED_ROWS = 32
# Rows up to which NVFP4 layers run on the kernel's tiles: every pass the fused decoder takes (above).
FP4_ROWS = MAX_DECODE_ROWS


class CpuLinear(nn.Module):
    """A frozen `nn.Linear` replacement; `weight` stays readable in `[out, in]` layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()  # [out, in]
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = w.dtype
        self.kernel = load() if w.shape[1] % 32 == 0 else None
        native_bf16 = cpu_plan().onednn_bf16
        self.kernel_rows = SMALL_ROWS if w.dtype == torch.float32 or native_bf16 else WIDENED_ROWS
        self._weight, self.weight_t, self.packed = w, None, None
        self._tiles = None  # the kernel's layout, made on the first small pass (see `forward`)
        if w.dtype != torch.float32 and native_bf16:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        elif w.dtype == torch.float32 and self.kernel is None:
            self._weight, self.weight_t = None, w.t().contiguous()  # [in, out]

    @property
    def weight(self) -> torch.Tensor:
        return self._weight if self._weight is not None else self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.kernel is not None and rows <= self.kernel_rows:
            return self.kernel.linear(x, self._kernel_tiles(), self._weight.shape[0], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.weight_t is not None:
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        # bf16 with neither the kernel nor oneDNN bf16: torch's own bf16 path for a few rows, the
        # weight widened to fp32 past them (table above).
        if self.dtype == torch.float32 or rows <= SMALL_ROWS:
            return F.linear(x, self._weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self._weight.float(), bias).to(self.dtype)

    def _kernel_tiles(self) -> torch.Tensor:
        """The kernel's layout of the weight, packed on first use: the layers the fused pass covers
        (engine/cpu/fused_decode.py) never see a small pass, so they never hold this extra copy."""
        if self._tiles is None:
            self._tiles = self.kernel.pack(self._weight)
        return self._tiles


class CpuLmHead(CpuLinear):
    """A dense LM head: as `CpuLinear`, and every row's argmax is the one the row alone gets.

    A pass of more than `kernel_rows` rows (a verify pass, a decode step of many sequences) runs on
    oneDNN or `F.linear`, which sum each logit in another order than the kernel that one-row decode
    steps use. Both sum in fp32; the bf16 results then differ by at most one bf16 step (on SmolLM2's
    head, AMX Xeon: 0.016 to 0.063 at 9 to 64 random rows, never bit-equal past 8), so a row whose
    top two logits are that close could be greedy-decoded differently by a verify pass than by plain
    decoding. Rows whose top two lie within `_rounding_margin` are computed again by the kernel (its
    rows do not depend on their batch): greedy answers stay token-identical to plain decoding at any
    batch, at the cost of a top-2 over the pass and the kernel on those rows (9% of real answers' rows);
    the other logits stay within a rounding step of the kernel's. On the AMX Xeon that took the head
    from 2.4 to 6.7 ms at 32 rows and decoding 1-7% (`benchmarks/lm_head_exactness.py`); the kernel on
    every row instead took 13.3 ms.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.kernel is None or x.numel() // x.shape[-1] <= self.kernel_rows:
            return y
        rows, logits = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [N, H], [N, V]
        top = logits.topk(2, dim=-1).values.float()  # [N, 2]
        close = (top[:, 0] - top[:, 1] <= _rounding_margin(top[:, 0], y.dtype)).nonzero()[:, 0]
        if len(close):
            logits[close] = self.kernel.linear(rows[close], self._kernel_tiles(), self._weight.shape[0], self.bias)
        return y


def _rounding_margin(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between a row's top two logits `[N]` below which summing in another order may swap them:
    two bf16 steps at their magnitude (each sum is rounded once to bf16's 8 bits, so each logit moves by
    at most one step), or 2^-10 of it in fp32 (a sum of 576 to a few thousand fp32 products drifts by
    about 2^-14 of it)."""
    scale = top.abs().clamp(min=1.0)
    if dtype == torch.bfloat16:
        return 2 * torch.exp2(torch.floor(torch.log2(scale)) - 7)
    return scale * 2.0 ** -10


class CpuNvfp4Linear(nn.Module):
    """A frozen `Nvfp4Linear` on the CPU: the kernel's NVFP4 tiles for few rows, dense past them."""

    def __init__(self, layer: Nvfp4Linear) -> None:
        super().__init__()
        self.q = layer.q
        self.out_features, self.in_features = layer.q.shape
        dense = nn.Linear(self.in_features, self.out_features, bias=layer.bias is not None,
                          dtype=layer.weight.dtype, device=layer.weight.device)
        dense.weight = nn.Parameter(layer.weight, requires_grad=False)
        if layer.bias is not None:
            dense.bias = nn.Parameter(layer.bias, requires_grad=False)
        self.dense = CpuLinear(dense)
        self.bias = layer.bias
        self.kernel = load() if self.in_features % FP4_CHUNK == 0 else None
        self._tiles = None  # packed on the first small pass, as `CpuLinear` does

    @property
    def weight(self) -> torch.Tensor:
        return self.dense.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.kernel is None or rows > FP4_ROWS:
            return self.dense(x)
        if self._tiles is None:
            self._tiles = self.kernel.pack_nvfp4(self.q.packed, self.q.block_scale.view(torch.uint8))
        return self.kernel.linear_nvfp4(x, self._tiles, self.out_features, float(self.q.tensor_scale), self.bias)


def _on_cpu(module: nn.Module) -> bool:
    tensor = next(itertools.chain(module.parameters(), module.buffers()))  # NVFP4 layers have only buffers
    return tensor.device.type == "cpu" and torch.backends.mkldnn.is_available()


def for_cpu_inference(linear: nn.Linear | Nvfp4Linear) -> nn.Module:
    """A frozen `linear` as a `CpuLinear` (or `CpuNvfp4Linear`) on the CPU; `linear` itself elsewhere."""
    if not _on_cpu(linear):
        return linear
    return CpuNvfp4Linear(linear) if isinstance(linear, Nvfp4Linear) else CpuLinear(linear)


def optimize_for_cpu_inference(model: nn.Module, fused: bool = True) -> nn.Module:
    """Swap every `nn.Linear` inside a frozen CPU model for a `CpuLinear`, in place, and give a
    `Transformer` the fused small-batch forward pass when `fused` and the kernels build; a no-op off
    the CPU. A bare `nn.Linear` has nothing inside it: use `for_cpu_inference`."""
    if not _on_cpu(model):
        return model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(module, Transformer) and name == "lm_head" and type(child) is nn.Linear:
                setattr(module, name, CpuLmHead(child))  # greedy decisions are made on its rows
            elif isinstance(child, nn.Linear | Nvfp4Linear):
                setattr(module, name, for_cpu_inference(child))
    if fused and isinstance(model, Transformer):
        attach(model)
    return model

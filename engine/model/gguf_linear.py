"""GGUF block weights in a `Transformer`: linear layers served from a GGUF file's own Q4_0, Q4_1,
Q8_0, Q4_K and Q6_K blocks by the C++ kernel (`linear_ggml` in `kernels/cpu_decode.cpp`), on the CPU.

`apply_gguf(model, blocks)` replaces the named `nn.Linear` modules (module paths as
`Transformer.named_modules` gives them: `layers.0.attn.qkv`, `lm_head`, ...) by `GgufLinear`s holding
the kernel's tiles of those blocks: the file's bytes reordered, 4.5 (Q4_0, Q4_K), 5 (Q4_1), 6.56
(Q6_K) or 8.5 (Q8_0) bits per weight, and nothing else. No dense copy is kept: passes run on the
tiles, but where oneDNN has AMX (`CpuPlan.dense_gguf_prefill`) passes of more than `KERNEL_ROWS` rows
(prefill chunks) multiply a bf16 copy made for that pass and dropped after it. Without AMX the kernel
is the faster at every size: on the Zen 3, 256 rows of a layer matrix took 0.63-0.73x the time of
dequantizing to fp32 and one fp32 GEMM; on a Zen 4 (AVX-512 BF16) 0.27-0.62x that of dequantizing to
bf16 and oneDNN's bf16 GEMM (docs/performance.md). The LM head always runs on the tiles,
so that a token's logits never depend on how many rows its pass had (prompt log-probs ask for a
whole chunk's). A fused module (qkv, gate_up) stacks the rows of its parts, which must
share one format and width. `weight` dequantizes on each read (the drafter's trimmed head reads it
once; a drafter trained against this target reads it every step).

This is the same model as the file (the same blocks; ggml also meets them with int8 activations,
though with fp16 activation scales where these are fp32), so it keeps the file's base-model
fingerprint (`engine/model/fingerprint.py`), unlike NVFP4. It is not
the file reader (`engine/loaders/gguf.py`) and not the kernel.
"""

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from specloop.kernels.cpu_decode import cpu_plan

# ggml type id -> (name, bytes per block, weights per block along a row): the formats the kernel reads.
BLOCK_FORMATS = {2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32), 8: ("Q8_0", 34, 32), 12: ("Q4_K", 144, 256),
                 14: ("Q6_K", 210, 256)}
KERNEL_ROWS = 64  # with AMX, passes of more rows multiply the weight dequantized for the pass


@dataclass(frozen=True)
class GgufBlocks:
    """A weight `[out, in]` as a GGUF file stores it: rows of blocks, `raw` uint8 `[out, blocks x bytes]`."""

    ggml_type: int
    raw: torch.Tensor

    def __post_init__(self) -> None:
        if self.ggml_type not in BLOCK_FORMATS:
            raise ValueError(f"ggml_type: {self.ggml_type} is not a block format the kernel reads "
                             f"({', '.join(f'{n} = {t}' for t, (n, _, _) in BLOCK_FORMATS.items())})")
        _, block_bytes, weights = BLOCK_FORMATS[self.ggml_type]
        if (self.raw.dtype != torch.uint8 or self.raw.ndim != 2 or self.raw.shape[1] % block_bytes
                or not self.raw.numel()):
            raise ValueError(f"raw: expected uint8 [out, in / {weights} x {block_bytes}], got {self.raw.dtype} "
                             f"{tuple(self.raw.shape)}")
        if not torch.isfinite(self.fp16_scales()).all():
            raise ValueError("raw: a block's fp16 scale is NaN or infinite")

    def fp16_scales(self) -> torch.Tensor:
        """Every block's fp16 scales (d; and m or dmin), as floats `[out, blocks, 1 or 2]`."""
        _, block_bytes, _ = BLOCK_FORMATS[self.ggml_type]
        blocks = self.raw.view(self.raw.shape[0], -1, block_bytes)
        halves = {3: slice(0, 4), 12: slice(0, 4), 14: slice(208, 210)}.get(self.ggml_type, slice(0, 2))
        return blocks[..., halves].contiguous().view(torch.float16).float()

    @property
    def shape(self) -> tuple[int, int]:
        _, block_bytes, weights = BLOCK_FORMATS[self.ggml_type]
        return self.raw.shape[0], self.raw.shape[1] // block_bytes * weights


def stack(parts: list[GgufBlocks]) -> GgufBlocks:
    """The rows of `parts` as one weight (a fused module's); they must share a format and a width."""
    formats, widths = {p.ggml_type for p in parts}, {p.shape[1] for p in parts}
    if len(formats) != 1:
        raise ValueError(f"a fused layer's parts are in {sorted(BLOCK_FORMATS[t][0] for t in formats)}: "
                         "the kernel takes one format per matrix")
    if len(widths) != 1:
        raise ValueError(f"a fused layer's parts have {sorted(widths)} columns: they must have the same")
    return GgufBlocks(parts[0].ggml_type, torch.cat([p.raw for p in parts]).contiguous())


class GgufLinear(nn.Module):
    """A frozen linear layer computed from GGUF blocks by `kernel`; `tiles` is all it holds of them."""

    def __init__(self, blocks: GgufBlocks, bias: torch.Tensor | None, dtype: torch.dtype, kernel: ModuleType,
                 dense_large_passes: bool = True) -> None:
        super().__init__()
        self.kernel, self.ggml_type, self.dtype = kernel, blocks.ggml_type, dtype
        self.dense_large_passes = dense_large_passes
        self.out_features, self.in_features = blocks.shape
        self.register_buffer("tiles", kernel.pack_ggml(blocks.raw, blocks.ggml_type), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight `[out, in]` in the layer's dtype, made on each read."""
        return self.kernel.dequantize_ggml(self.tiles, self.out_features, self.ggml_type, self.dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= KERNEL_ROWS or not self.dense_large_passes or not cpu_plan().dense_gguf_prefill:
            return self.kernel.linear_ggml(x, self.tiles, self.out_features, self.ggml_type, self.bias)
        # A prefill chunk on AMX: the weight dequantized for this pass only, one GEMM, dropped.
        w = self.kernel.dequantize_ggml(self.tiles, self.out_features, self.ggml_type, self.dtype == torch.bfloat16)
        return F.linear(x.to(self.dtype), w, self.bias).to(x.dtype)


def apply_gguf(model: nn.Module, blocks: dict[str, GgufBlocks], kernel: ModuleType) -> None:
    """Replace each named linear module by a `GgufLinear` of its blocks, in place."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(blocks) - set(modules))
    if unknown:
        raise ValueError(f"GGUF blocks for modules the model does not have: {unknown[:5]}")
    for name, b in blocks.items():
        old = modules[name]
        if b.shape != tuple(old.weight.shape):
            raise ValueError(f"{name}: GGUF blocks {b.shape} do not match the module's {tuple(old.weight.shape)}")
        new = GgufLinear(b, old.bias, old.weight.dtype, kernel, dense_large_passes=name != "lm_head")
        model.set_submodule(name, new)

"""NVFP4, NVIDIA's 4-bit weight format, as an exact torch reference.

An NVFP4 weight `[N, K]` keeps each value as a 4-bit E2M1 code (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), one E4M3 scale per 16 consecutive values along K and one FP32 scale for the whole tensor,
so w ~= E2M1[code] x block_scale x tensor_scale. That is 4 + 8/16 = 4.5 bits per weight: a decode step
bound by streaming weights can be at most 16/4.5 = 3.56x faster than from bf16.

This file is the definition every NVFP4 kernel (Triton, C++) and the checkpoint code are tested
against, so each rounding is spelled out instead of left to a fast path: E2M1 from the table with
ties to the even code, E4M3 through torch's cast (round-to-nearest-even, subnormals included,
which the tests check at every midpoint of its 127 magnitudes), all in float32.
It is not checkpoint I/O and not a kernel; it is written to be obviously right, not fast.

Quantizing dequantized weights gives the same bytes whenever every block scale is a normal E4M3
value (>= 2^-6). A subnormal block scale can come back as a smaller one: a block scale of 2 x 2^-9
whose largest code is 4 re-quantizes at 4 x 2 / 6 = 1.33 x 2^-9, which rounds to 2^-9.
"""

from dataclasses import dataclass

import torch

BLOCK = 16  # values per E4M3 block scale, along K
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Code -> value; bit 3 is the sign, so 0b1000 is -0.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# Midpoint i lies between codes i and i + 1; a value exactly on it goes to the even code.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)

_TILE_ROWS, _TILE_COLS = 128, 4  # the scale tile cuBLAS and CUTLASS read as one 512-element unit


@dataclass(frozen=True)
class NVFP4Weight:
    """An `[N, K]` weight in NVFP4. Built by `quantize` or from a checkpoint's three tensors."""

    packed: torch.Tensor  # uint8 [N, K/2]: element 2j in the low nibble of byte j, 2j + 1 in the high
    block_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    tensor_scale: torch.Tensor  # float32, 0-dim

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.packed.ndim != 2 or self.packed.shape[1] % (BLOCK // 2):
            raise ValueError(f"packed: expected uint8 [N, K/2] with K a multiple of {BLOCK}, "
                             f"got {self.packed.dtype} {tuple(self.packed.shape)}")
        n, k = self.shape
        if self.block_scale.dtype != torch.float8_e4m3fn or self.block_scale.shape != (n, k // BLOCK):
            raise ValueError(f"block_scale: expected float8_e4m3fn {(n, k // BLOCK)}, "
                             f"got {self.block_scale.dtype} {tuple(self.block_scale.shape)}")
        if self.tensor_scale.dtype != torch.float32 or self.tensor_scale.ndim != 0:
            raise ValueError(f"tensor_scale: expected a 0-dim float32 tensor, "
                             f"got {self.tensor_scale.dtype} {tuple(self.tensor_scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def quantize(w: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> NVFP4Weight:
    """NVFP4 of a floating `[N, K]` tensor, K a multiple of 16; computed in float32 (a float64 input
    is rounded to float32 first).

    `tensor_scale` (a positive 0-dim float32) replaces amax(|w|)/(6 x 448): layers that a runtime
    fuses into one GEMM (q/k/v, gate/up) must share one, so each is quantized with the scale of
    their concatenation. A scale below w's own lets block scales reach 448 and values saturate.
    """
    _check_weight(w)
    w = w.float()
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)  # [N, K/16, 16]
    if tensor_scale is None:
        tensor_scale = _tensor_scale(w)
    else:
        _check_tensor_scale(tensor_scale)
        tensor_scale = tensor_scale.to(w.device)
    block_scale = _block_scales(blocks, tensor_scale)  # [N, K/16]
    scale = (block_scale.float() * tensor_scale)[..., None]  # [N, K/16, 1]
    # A zero scale means an all-zero block (or one too small for E4M3 next to the tensor's largest
    # block): its codes are zero instead of 0/0.
    scaled = torch.where(scale > 0, blocks / scale, 0.0)
    # The sign is the input's, so a negative that rounds to zero is code 0b1000 (-0), which
    # dequantizes and re-quantizes to itself.
    codes = _magnitude_codes(scaled.abs()) | (torch.signbit(blocks).to(torch.uint8) << 3)
    return NVFP4Weight(pack_codes(codes.reshape(n, k)), block_scale, tensor_scale)


def dequantize(q: NVFP4Weight) -> torch.Tensor:
    """The float32 `[N, K]` weights `q` stands for."""
    n, k = q.shape
    codes = unpack_codes(q.packed).long().reshape(n, k // BLOCK, BLOCK)  # [N, K/16, 16]
    values = E2M1_VALUES.to(codes.device)[codes]
    # An E2M1 value times an E4M3 scale has at most 2 + 4 significant bits, exact in float32, so
    # each weight is rounded once, by the tensor scale.
    return (values * q.block_scale.float()[..., None] * q.tensor_scale).reshape(n, k)


def _check_weight(w: torch.Tensor) -> None:
    if w.ndim != 2 or w.numel() == 0 or w.shape[1] % BLOCK:
        raise ValueError(f"w: expected a non-empty [N, K] tensor with K a multiple of {BLOCK}, "
                         f"got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point tensor, got {w.dtype}")
    if not torch.isfinite(w).all():
        raise ValueError("w: contains NaN or infinity")


def _check_tensor_scale(scale: torch.Tensor) -> None:
    if scale.dtype != torch.float32 or scale.ndim != 0:
        raise ValueError(f"tensor_scale: expected a 0-dim float32 tensor, got {scale.dtype} {tuple(scale.shape)}")
    if not (torch.isfinite(scale) and scale > 0):
        raise ValueError(f"tensor_scale: expected a positive finite value, got {scale.item()}")


def _tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """amax / (6 x 448), so the largest block's scale is E4M3's largest value; 1.0 where that is zero
    (an all-zero tensor, or |w| below 2688 x float32's smallest subnormal, 3.8e-42)."""
    scale = w.abs().amax() / (E2M1_MAX * E4M3_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _block_scales(blocks: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scale of each 16-value block `[N, K/16, 16]`, relative to the tensor scale."""
    amax = blocks.abs().amax(dim=-1)  # [N, K/16]
    # Float error can put the largest block a few ulps past 448. torch 2.13's CPU cast saturates
    # there (its header maps finite overflow and inf to 448), but a non-saturating cast gives NaN
    # past 464; the clamp makes the result independent of which one runs.
    return ((amax / E2M1_MAX) / tensor_scale).clamp(0.0, E4M3_MAX).to(torch.float8_e4m3fn)


def _magnitude_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """The 3-bit E2M1 code nearest each non-negative value, ties to the even code, saturating at 6."""
    midpoints = _E2M1_MIDPOINTS.to(magnitude.device)
    below = torch.bucketize(magnitude, midpoints, right=False)  # midpoints < magnitude
    at_or_below = torch.bucketize(magnitude, midpoints, right=True)  # midpoints <= magnitude
    # They differ only on a midpoint, between codes `below` and `at_or_below`: keep the even one.
    return torch.where(at_or_below % 2 == 0, at_or_below, below).to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 `[..., K]`, K even) two per byte: `[..., K/2]`, even index in the low nibble."""
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: expected uint8 [..., K] with K even, got {codes.dtype} {tuple(codes.shape)}")
    if codes.numel() and codes.max() > 0xF:
        raise ValueError(f"codes: 4-bit codes are 0..15, got {codes.max().item()}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_codes`: uint8 `[..., K/2]` -> `[..., K]`."""
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise ValueError(f"packed: expected uint8 [..., K/2], got {packed.dtype} {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Scales `[R, C]` in the layout cuBLAS's and CUTLASS's block-scaled GEMMs read, flat.

    Zero-pads to a multiple of 128 rows and 4 columns, then stores each 128 x 4 tile as 512
    consecutive elements: 32 lines of 16, line i holding rows i, i + 32, i + 64, i + 96 with their 4
    scales each. Tiles follow row tile by row tile, column tiles within, so (r, c) lands at
    512 x (r // 128 x C'/4 + c // 4) + 16 x (r % 32) + 4 x ((r % 128) // 32) + c % 4, C' the padded
    column count.
    """
    if s.ndim != 2:
        raise ValueError(f"s: expected a [R, C] tensor, got shape {tuple(s.shape)}")
    rows, cols = s.shape
    padded = s.new_zeros(_round_up(rows, _TILE_ROWS), _round_up(cols, _TILE_COLS))  # [R', C']
    padded[:rows, :cols] = s
    # [R'/128, (r % 128) // 32, r % 32, C'/4, c % 4], then the middle three axes reversed
    tiles = padded.reshape(padded.shape[0] // _TILE_ROWS, 4, 32, padded.shape[1] // _TILE_COLS, _TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of `swizzle_scales`: the `[rows, cols]` scales, padding dropped."""
    if rows < 0 or cols < 0:
        raise ValueError(f"rows, cols: expected non-negative sizes, got {rows}, {cols}")
    padded_rows, padded_cols = _round_up(rows, _TILE_ROWS), _round_up(cols, _TILE_COLS)
    if flat.ndim != 1 or flat.numel() != padded_rows * padded_cols:
        raise ValueError(f"flat: expected {padded_rows * padded_cols} elements ({rows} x {cols} padded to "
                         f"{padded_rows} x {padded_cols}), got shape {tuple(flat.shape)}")
    tiles = flat.reshape(padded_rows // _TILE_ROWS, padded_cols // _TILE_COLS, 32, 4, _TILE_COLS)
    # Reversing the middle three axes again undoes the swizzle.
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)[:rows, :cols].contiguous()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple

"""`x @ W.T` with W in NVFP4, as Triton kernels for GPUs: decode and verify shapes, 1 to 64 rows.

The kernel streams the weight in its 4.5-bit form (uint8 codes, uint8 E4M3 block scales), decodes both
in registers, and feeds a bf16 `tl.dot` with fp32 accumulation: native FP4 MMA exists only on
Blackwell, so on Hopper and older the dequantize-then-bf16-MMA path is the one there is. At 1 to 16
rows the kernel is bound by streaming the weight; at 64, 2 x 64 flops per 0.56-byte weight is near
an H200's ridge (990 dense bf16 TFLOP/s over 4.8 TB/s, 206 flops per byte). The format is
`kernels/nvfp4.py`; this file follows it bit for bit and is tested against its `dequantize`.

Decoding is exact. Both 4-bit and 8-bit codes are laid into fp16 bit patterns (below), so a code
times its block scale has at most 2 + 4 significant bits and is exact in bf16; the only roundings
are of the activations (none for bf16, tf32's 10 mantissa bits for fp32 on a GPU), the fp32
accumulation, and the output cast. The tensor scale multiplies the fp32 sum once, at the end.

Without a GPU the kernels run under Triton's interpreter: `TRITON_INTERPRET=1` must be set before
triton is first imported, since `triton.jit` reads it when it decorates and triton's own helpers
(`tl.zeros`, ...) are decorated as it loads. The interpreter's bf16 `tl.dot` works on raw bits, so
there the dot runs in fp32 on the same (exact) weight values.

This file is not the format, not checkpoint I/O and not the choice of which path a layer takes
(`engine/model/nvfp4_linear.py` decides that).
"""

from functools import cache

import torch
import triton
import triton.language as tl

from specloop.kernels.nvfp4 import BLOCK, NVFP4Weight

MAX_ROWS = 64  # decode and verify passes; larger M is a prefill, where a dense GEMM reuses each weight
# One CTA covers BLOCK_N output columns and BLOCK_K inputs per step: for bf16 activations 256 codes,
# 128 bytes of each of 64 weight rows, a full 128-byte line per row. fp32 activations take twice the
# shared memory per pipeline stage: at 256 with 64 rows a CTA needs 208 KB on sm_90 (145 KB on sm_80,
# over the 99 KB of sm_86/89 cards), at 128 104 KB and 72 KB (figures from compiling for those targets).
# Not yet tuned on a GPU.
BLOCK_N = 64
BLOCK_K = {torch.bfloat16: 256, torch.float32: 128}
REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction
# The interpreter has no SMs; as many as an H100's or H200's makes it split K as one of those would.
INTERPRETER_SMS = 132
# E2M1's 3 magnitude bits sit at fp16 bits 9..11 and E4M3's 7 at bits 7..13, which makes each an
# fp16 number 2^14 resp. 2^8 times too small (subnormals included: fp16 has them in hardware); the
# kernel multiplies the accumulator by the tensor scale times 2^22 to undo both.
_FP16_PLACEMENT = tl.constexpr(2.0**22)
_SCALE_BLOCK = tl.constexpr(BLOCK)

_INTERPRETED = triton.knobs.runtime.interpret


def nvfp4_linear(x: torch.Tensor, q: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ dequantize(q).T (+ bias)` in x's dtype, accumulated in fp32.

    x: `[..., K]` bf16 or fp32 with a contiguous last dimension and at most 64 rows in all;
    q: an `[N, K]` NVFP4 weight with contiguous tensors on x's device; bias: `[N]` in x's dtype.
    Returns `[..., N]`.
    """
    _check(x, q, bias)
    n, k = q.shape
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    block_k = BLOCK_K[x.dtype]
    n_tiles, k_tiles = triton.cdiv(n, BLOCK_N), triton.cdiv(k, block_k)
    split, tiles_per_split = split_k(n_tiles, k_tiles, _sm_count(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    # Split-K writes fp32 partials that a second pass sums in a fixed order, instead of atomic adds
    # into a zeroed output: the same input gives the same bits on every run (a greedy token must not
    # depend on which CTA finished first), and the partial buffer needs no memset.
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out  # [S, M, N]
    _nvfp4_matmul_kernel[(n_tiles, split)](
        x2, q.packed, q.block_scale.view(torch.uint8), q.tensor_scale, bias, partial,
        m, n, k, x2.stride(0), q.packed.stride(0), q.block_scale.stride(0), tiles_per_split,
        SPLIT=split, HAS_BIAS=bias is not None, DOT_BF16=x.dtype == torch.bfloat16 and not _INTERPRETED,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=BLOCK_N, BLOCK_K=block_k,
    )
    if split > 1:
        _split_k_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            partial, q.tensor_scale, bias, out, m * n, n,
            SPLIT=split, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK,
        )
    return out.reshape(*x.shape[:-1], n)


def split_k(n_tiles: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """(splits, K tiles per split) for a grid of `n_tiles` output tiles on `sms` SMs.

    Below one wave of CTAs a decode GEMV leaves SMs idle and memory bandwidth unused, so K is split
    until there are about two CTAs per SM; at a wave or more, splitting only adds the partial sums'
    traffic. Tiles are shared out so that no split is empty.
    """
    assert n_tiles > 0 and k_tiles > 0 and sms > 0
    wanted = 1 if n_tiles >= sms else triton.cdiv(2 * sms, n_tiles)
    tiles_per_split = triton.cdiv(k_tiles, min(wanted, k_tiles))
    return triton.cdiv(k_tiles, tiles_per_split), tiles_per_split


@cache
def _sm_count(device: torch.device) -> int:
    return INTERPRETER_SMS if _INTERPRETED else torch.cuda.get_device_properties(device).multi_processor_count


def _check(x: torch.Tensor, q: NVFP4Weight, bias: torch.Tensor | None) -> None:
    n, k = q.shape
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected bfloat16 or float32, got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(f"x: expected [..., {k}] to match the weight's K, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"x: expected a contiguous last dimension, got strides {x.stride()}")
    rows = x.numel() // k
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x: expected 1 to {MAX_ROWS} rows (decode and verify), got {rows}")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"x: expected a CUDA tensor (or TRITON_INTERPRET=1 before import), got {x.device}")
    for name, t in (("q.packed", q.packed), ("q.block_scale", q.block_scale), ("q.tensor_scale", q.tensor_scale)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device
                             or not bias.is_contiguous()):
        raise ValueError(f"bias: expected a contiguous [{n}] {x.dtype} tensor on {x.device}, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


@triton.jit
def _e2m1_as_fp16(code):
    """4-bit codes (uint16, 0..15) as fp16 values 2^-14 times the E2M1 ones: the sign to bit 15,
    exponent and mantissa to bits 10..11 and 9, so exponent 0 is an fp16 subnormal."""
    return (((code & 0x7) << 9) | ((code & 0x8) << 12)).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_as_fp16(byte):
    """E4M3 bytes (uint16) as fp16 values 2^-8 times the E4M3 ones: exponent bias 7 and 15 differ by
    8, the 3 mantissa bits land on fp16's top 3, and exponent 0 stays subnormal (2^-6 x m/8 becomes
    2^-14 x m/8). 0x7F, E4M3's NaN, never appears in a valid weight and decodes to 480."""
    return (((byte & 0x7F) << 7) | ((byte & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def _epilogue(acc, n, mask, tensor_scale_ptr, bias_ptr, HAS_BIAS: tl.constexpr):
    """fp32 outputs from fp32 sums over code x block-scale products; `n` is each one's column."""
    acc = acc * (tl.load(tensor_scale_ptr) * _FP16_PLACEMENT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _nvfp4_matmul_kernel(
    x_ptr, packed_ptr, scale_ptr, tensor_scale_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, TILES_PER_SPLIT,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` output tile over one split's K tiles. With SPLIT == 1 it writes the
    final output, else fp32 partials `[SPLIT, M, N]` (`out_ptr`) for `_split_k_reduce_kernel`.

    A byte holds codes 2j (low nibble) and 2j + 1 (high), so the tile is two dots: even columns of x
    against the low nibbles and odd against the high, which keeps the bytes in place instead of
    interleaving nibbles in registers. The weight is read as `[BLOCK_K/16, 8, BLOCK_N]` bytes, 8 per
    block scale, so each scale multiplies its bytes by broadcasting. x is read whole, 16-byte loads,
    and split into even and odd columns in registers: read at stride 2 it took one 2-byte load per
    element (PTX for sm_90).
    """
    GROUPS: tl.constexpr = BLOCK_K // _SCALE_BLOCK  # block scales per row per K tile
    BYTES: tl.constexpr = _SCALE_BLOCK // 2  # bytes per block scale
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    group = tl.arange(0, GROUPS)
    byte_in_tile = group[:, None, None] * BYTES + tl.arange(0, BYTES)[None, :, None]  # [G, 8, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(TILES_PER_SPLIT):
        tile = pid_k * TILES_PER_SPLIT + t
        byte = tile * (BLOCK_K // 2) + byte_in_tile  # [G, 8, 1] along K/2
        codes = tl.load(packed_ptr + cols[None, None, :] * stride_wn + byte,
                        mask=(byte < K // 2) & col_ok[None, None, :], other=0).to(tl.uint16)  # [G, 8, BN]
        g = tile * GROUPS + group  # [G] along K/16
        scale = tl.load(scale_ptr + cols[None, :] * stride_sn + g[:, None],
                        mask=(g[:, None] < K // _SCALE_BLOCK) & col_ok[None, :], other=0)  # [G, BN]
        scale = _e4m3_as_fp16(scale.to(tl.uint16)).to(tl.float32)[:, None, :]  # [G, 1, BN]
        lo = tl.reshape(_e2m1_as_fp16(codes & 0xF).to(tl.float32) * scale, (BLOCK_K // 2, BLOCK_N))
        hi = tl.reshape(_e2m1_as_fp16(codes >> 4).to(tl.float32) * scale, (BLOCK_K // 2, BLOCK_N))
        k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=row_ok[:, None] & (k[None, :] < K), other=0.0)  # [BM, BK]
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))  # [BM, BK/2] each
        if DOT_BF16:
            acc = tl.dot(x_even, lo.to(tl.bfloat16), acc)
            acc = tl.dot(x_odd, hi.to(tl.bfloat16), acc)
        else:  # fp32 activations (tf32 on a GPU), or bf16 ones under the interpreter
            acc = tl.dot(x_even.to(tl.float32), lo, acc)
            acc = tl.dot(x_odd.to(tl.float32), hi, acc)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT == 1:
        acc = _epilogue(acc, cols[None, :], col_ok[None, :], tensor_scale_ptr, bias_ptr, HAS_BIAS)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (pid_k * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(partial_ptr, tensor_scale_ptr, bias_ptr, out_ptr, MN, N,
                           SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out `[M, N]` = epilogue(sum over splits of partial `[SPLIT, M, N]`), splits in order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    acc = _epilogue(acc, offs % N, mask, tensor_scale_ptr, bias_ptr, HAS_BIAS)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

"""The C++ kernel on GGUF's own blocks (`pack_ggml`, `linear_ggml`, `unpack_ggml` in
`kernels/cpu_decode.cpp`) of every build this CPU runs: the tiles decode bit for bit to what the `gguf`
package dequantizes, products match the fp32 dequantized weights, and bad input is refused."""

from types import ModuleType

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specloop.kernels.cpu_decode import load
from specloop.kernels.cpu_features import Isa

Q4_K, Q6_K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
FORMATS = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, Q4_K, Q6_K]


@pytest.fixture
def kernel(kernel_isa: Isa) -> ModuleType:
    module = load(kernel_isa)
    assert module is not None and module.isa == kernel_isa, f"the {kernel_isa} build did not load"
    return module


def gguf_tensor(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """A random weight in `qtype` as the file stores it (uint8 [out, row bytes]) and its dequantization."""
    rng = np.random.default_rng(seed)
    if qtype in (Q4_K, Q6_K):
        raw = k_quant_blocks(shape, qtype, rng)
    else:
        w = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block: scale 0
        raw = quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)), dequantize(raw, qtype)


def k_quant_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K or Q6_K super-blocks (the gguf package dequantizes them but cannot quantize): every
    code and sub-block scale byte random, the fp16 scales (Q4_K: d and dmin first; Q6_K: d last) of a
    typical weight's size."""
    out, n_in = shape
    size = {Q4_K: 144, Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, (out, n_in // 256, size), dtype=np.uint8)
    if qtype == Q4_K:
        blocks[:, :, :4] = (rng.uniform(0.5, 1.5, (out, n_in // 256, 2)) * n_in ** -0.5 / 63 / 8).astype(
            np.float16).view(np.uint8)
    else:
        blocks[:, :, -2:] = (rng.uniform(0.5, 1.5, (out, n_in // 256, 1)) * n_in ** -0.5 / 128 / 32).astype(
            np.float16).view(np.uint8)
    return blocks.reshape(out, -1)


def relative_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (130, 768)])
def test_tiles_decode_to_the_gguf_reference_bit_for_bit(kernel: ModuleType, qtype: GGMLQuantizationType,
                                                        shape: tuple[int, int]) -> None:
    raw, reference = gguf_tensor(shape, qtype)
    q, d, m = kernel.unpack_ggml(kernel.pack_ggml(raw, int(qtype)), shape[0], int(qtype))
    assert q.shape == shape and d.shape == m.shape == (shape[0], shape[1] // 16)
    codes = q.numpy().astype(np.float32).reshape(shape[0], -1, 16)
    d, m = d.numpy()[..., None], m.numpy()[..., None]
    # As ggml (and the gguf package) form each weight: two roundings for Q4_1, one otherwise.
    rebuilt = {GGMLQuantizationType.Q4_0: lambda: d * (codes - 8), GGMLQuantizationType.Q4_1: lambda: d * codes + m,
               GGMLQuantizationType.Q8_0: lambda: d * codes, Q4_K: lambda: d * codes + m,
               Q6_K: lambda: d * (codes - 32)}[qtype]().reshape(shape)
    np.testing.assert_array_equal(rebuilt.view(np.uint32), reference.astype(np.float32).view(np.uint32))
    dense = kernel.dequantize_ggml(kernel.pack_ggml(raw, int(qtype)), shape[0], int(qtype), False)
    np.testing.assert_array_equal(dense.numpy().view(np.uint32), reference.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_dequantized_weights(kernel: ModuleType, qtype: GGMLQuantizationType, rows: int,
                                                dtype: torch.dtype) -> None:
    raw, reference = gguf_tensor((200, 768), qtype, seed=rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, 768).to(dtype)
    expected = x.float() @ torch.from_numpy(reference).T
    got = kernel.linear_ggml(x, kernel.pack_ggml(raw, int(qtype)), 200, int(qtype))
    assert got.shape == (rows, 200) and got.dtype == dtype
    # int8 activations add a relative error about 2^-9 per product (the NVFP4 path's bound, 1e-2,
    # holds with room); bf16 output rounding adds 2^-9 more.
    assert relative_l2(got, expected) < 1e-2


def test_bias_and_leading_dims(kernel: ModuleType) -> None:
    raw, reference = gguf_tensor((130, 128), GGMLQuantizationType.Q4_1)
    x, bias = torch.randn(2, 3, 128), torch.randn(130)
    got = kernel.linear_ggml(x, kernel.pack_ggml(raw, int(GGMLQuantizationType.Q4_1)), 130,
                             int(GGMLQuantizationType.Q4_1), bias)
    assert got.shape == (2, 3, 130)
    assert relative_l2(got, x @ torch.from_numpy(reference).T + bias) < 1e-2


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch(kernel: ModuleType, qtype: GGMLQuantizationType) -> None:
    raw, _ = gguf_tensor((300, 512), qtype)
    tiles = kernel.pack_ggml(raw, int(qtype))
    x = torch.randn(11, 512)
    batched = kernel.linear_ggml(x, tiles, 300, int(qtype))
    for i in range(11):
        assert torch.equal(kernel.linear_ggml(x[i:i + 1], tiles, 300, int(qtype)), batched[i:i + 1])


def extreme_blocks(qtype: GGMLQuantizationType, out: int, n_in: int) -> tuple[np.ndarray, float]:
    """Rows of `qtype` whose every weight is the code farthest from zero (Q8_0: -128; Q4_1: 15; Q6_K:
    63 less 32) at d = 0.5 (Q6_K: sub-block scales 1), as the file stores them, and that weight."""
    half = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    if qtype == GGMLQuantizationType.Q8_0:
        raw = np.zeros((out, n_in // 32, 34), np.uint8)
        raw[:, :, :2] = half
        raw[:, :, 2:] = np.int8(-128).view(np.uint8)
        return raw.reshape(out, -1), 0.5 * -128
    if qtype == GGMLQuantizationType.Q4_1:
        raw = np.zeros((out, n_in // 32, 20), np.uint8)
        raw[:, :, :2] = half  # d, then m = 0
        raw[:, :, 4:] = 0xFF
        return raw.reshape(out, -1), 0.5 * 15
    raw = np.zeros((out, n_in // 256, 210), np.uint8)
    raw[:, :, :192] = 0xFF  # every 4-bit and 2-bit part set: code 63
    raw[:, :, 192:208] = 1
    raw[:, :, 208:] = half
    return raw.reshape(out, -1), 0.5 * (63 - 32)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_codes_stay_exact(kernel: ModuleType, qtype: GGMLQuantizationType, sign: float) -> None:
    """The largest codes against activations of +-127 are the largest products the kernel sums in int16
    (Q8_0's pairs, a block's eight parts of Q4_1, two of Q6_K): the sums stay exact, for 1, 4 and 8 rows."""
    out, n_in = 8, 512
    raw, weight = extreme_blocks(qtype, out, n_in)
    tiles = kernel.pack_ggml(torch.from_numpy(np.ascontiguousarray(raw)), int(qtype))
    x = torch.full((8, n_in), 3.0 * sign)
    for rows in (1, 4, 8):
        got = kernel.linear_ggml(x[:rows], tiles, out, int(qtype))
        torch.testing.assert_close(got, torch.full((rows, out), weight * 3.0 * sign * n_in), rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_x86_builds_agree_bit_for_bit(x86_kernels: list[ModuleType], qtype: GGMLQuantizationType) -> None:
    """The AVX-512 build sums a block by VPDPBUSD, AVX2 by VPMADDUBSW and VPMADDWD: both sums are exact
    integers and the fp32 steps after them are the same, so every output is the same float (1 and 2
    rows take the AVX-512 build's one-chain form, 11 rows groups of 8 and 3 its two-chain one)."""
    raw, _ = gguf_tensor((300, 512), qtype)
    tiles = [kernel.pack_ggml(raw, int(qtype)) for kernel in x86_kernels]
    for rows in (1, 2, 11):
        x = torch.randn(rows, 512) * 4.0
        first, *others = (k.linear_ggml(x, t, 300, int(qtype)) for k, t in zip(x86_kernels, tiles))
        for other in others:
            assert torch.equal(other, first), f"{rows} rows"


def test_bad_input_is_refused(kernel: ModuleType) -> None:
    raw, _ = gguf_tensor((8, 64), GGMLQuantizationType.Q4_1)
    with pytest.raises(RuntimeError, match="ggml_type: 10 is not a block format"):
        kernel.pack_ggml(raw, 10)  # Q2_K
    with pytest.raises(RuntimeError, match="whole blocks of 18 bytes"):
        kernel.pack_ggml(raw, int(GGMLQuantizationType.Q4_0))  # Q4_1 rows (20-byte blocks) called Q4_0
    tiles = kernel.pack_ggml(raw, int(GGMLQuantizationType.Q4_1))
    with pytest.raises(RuntimeError, match="tiles: expected the output of pack_ggml"):
        kernel.linear_ggml(torch.randn(1, 64), tiles, 8, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="x: expected bf16 or fp32"):
        kernel.linear_ggml(torch.randn(1, 96), tiles, 8, int(GGMLQuantizationType.Q4_1))

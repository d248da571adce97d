"""The C++ NVFP4 matrix kernel (`linear_nvfp4` in `kernels/cpu_decode.cpp`) of every build this CPU
runs, against the format's reference `x.float() @ dequantize(q).T`, and its refusals."""

from types import ModuleType

import pytest
import torch

from specloop.kernels.cpu_decode import load
from specloop.kernels.cpu_features import Isa
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize, quantize


@pytest.fixture
def kernel(kernel_isa: Isa) -> ModuleType:
    module = load(kernel_isa)
    assert module is not None and module.isa == kernel_isa, f"the {kernel_isa} build did not load"
    return module


def nvfp4_linear(kernel: ModuleType, x: torch.Tensor, q: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    tiles = kernel.pack_nvfp4(q.packed, q.block_scale.view(torch.uint8))
    return kernel.linear_nvfp4(x, tiles, q.shape[0], float(q.tensor_scale), bias)


def relative_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64])
@pytest.mark.parametrize("shape", [(75, 64), (200, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_the_reference(kernel: ModuleType, rows: int, shape: tuple[int, int],
                                      dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    n_out, n_in = shape
    q = quantize(torch.randn(n_out, n_in) * n_in ** -0.5)
    x = torch.randn(rows, n_in).to(dtype)
    expected = x.float() @ dequantize(q).T
    got = nvfp4_linear(kernel, x, q)
    assert got.shape == (rows, n_out) and got.dtype == dtype
    assert relative_l2(got, expected) < 1e-2
    assert torch.nn.functional.cosine_similarity(got.double().flatten(), expected.double().flatten(), dim=0) > 0.999


def test_bias_and_leading_dims(kernel: ModuleType) -> None:
    torch.manual_seed(0)
    q = quantize(torch.randn(130, 128))
    x, bias = torch.randn(2, 3, 128), torch.randn(130)
    got = nvfp4_linear(kernel, x, q, bias)
    assert got.shape == (2, 3, 130)
    assert relative_l2(got, x @ dequantize(q).T + bias) < 1e-2


def test_rows_do_not_depend_on_the_batch(kernel: ModuleType) -> None:
    torch.manual_seed(0)
    q = quantize(torch.randn(300, 576))
    x = torch.randn(11, 576)
    batched = nvfp4_linear(kernel, x, q)
    for i in range(11):
        assert torch.equal(nvfp4_linear(kernel, x[i:i + 1], q), batched[i:i + 1])


def test_zero_blocks_and_small_scales_are_exact_zeros(kernel: ModuleType) -> None:
    w = torch.zeros(8, 64)
    w[0, :16] = torch.linspace(-1, 1, 16)
    w[1, 16:32] = 1e-5  # a block whose E4M3 scale is subnormal next to the tensor's largest
    q = quantize(w)
    x = torch.randn(3, 64)
    got = nvfp4_linear(kernel, x, q)
    expected = x @ dequantize(q).T
    assert torch.equal(got[:, 2:], torch.zeros(3, 6))
    assert relative_l2(got, expected) < 1e-2


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_codes_against_extreme_activations_are_exact(kernel: ModuleType, sign: float) -> None:
    """Every weight at the format's largest magnitude (code 12 + 2 x 6 = 24, or 0) against activations
    that quantize to +-127: a register's int16 lanes hold four parts' sums at their bound (24,384),
    and any more added there, or a saturating pair, would show here."""
    w = torch.full((8, 576), 6.0)
    w[1::2] = -6.0
    q = quantize(w)
    x = torch.full((5, 576), sign)
    x[1, ::3] = -sign
    expected = x @ dequantize(q).T
    got = nvfp4_linear(kernel, x, q)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-3), (got - expected).abs().max()


def test_the_x86_builds_agree_bit_for_bit(x86_kernels: list[ModuleType]) -> None:
    """VPDPBUSD (AVX-512) and VPMADDUBSW with VPMADDWD (AVX2) give the same exact integer sums, and
    the fp32 steps after them are the same."""
    torch.manual_seed(0)
    q = quantize(torch.randn(300, 576))
    x = torch.randn(11, 576) * 4.0
    first, *others = (nvfp4_linear(kernel, x, q) for kernel in x86_kernels)
    for other in others:
        assert torch.equal(other, first)


def test_refuses_what_it_cannot_run(kernel: ModuleType) -> None:
    q = quantize(torch.randn(8, 64))
    codes, scales = q.packed, q.block_scale.view(torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.pack_nvfp4(quantize(torch.randn(8, 48)).packed, quantize(torch.randn(8, 48)).block_scale.view(torch.uint8))
    with pytest.raises(RuntimeError, match="block_scale"):
        kernel.pack_nvfp4(codes, scales[:, :2].contiguous())
    with pytest.raises(RuntimeError, match="non-negative"):
        kernel.pack_nvfp4(codes, scales | 0x80)
    tiles = kernel.pack_nvfp4(codes, scales)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        kernel.linear_nvfp4(torch.randn(1, 32), tiles, 8, 1.0)
    with pytest.raises(RuntimeError, match="pack_nvfp4"):
        kernel.linear_nvfp4(torch.randn(1, 64), tiles, 12, 1.0)

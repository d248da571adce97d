"""The C++ `linear` against a float64 reference over odd row counts, bf16 and fp32, with and without bias.

Skipped where the kernels cannot exist (no AVX-512 BF16); on this project's CPU they always build.
"""

import pytest
import torch

from kernels.cpu_decode import load

kernel = load()
pytestmark = pytest.mark.skipif(kernel is None, reason="CPU decode kernels need AVX-512 BF16 and a compiler")


# Products and sums are fp32; for bf16 the only large error is the final rounding of the output.
TOLERANCE = {torch.bfloat16: 2 ** -8, torch.float32: 1e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("shape", [(32, 7), (96, 200), (576, 960), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(rows: int, shape: tuple[int, int], bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    n_in, n_out = shape
    w = (torch.randn(n_out, n_in) * n_in ** -0.5).to(dtype)
    b = torch.randn(n_out).to(dtype) if bias else None
    x = torch.randn(rows, n_in).to(dtype)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernel.linear(x, kernel.pack(w), n_out, b)
    assert got.shape == (rows, n_out) and got.dtype == dtype
    assert (got.double() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max() + 1e-6


def test_linear_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 576).bfloat16()
    x = torch.randn(11, 576).bfloat16()
    tiles = kernel.pack(w)
    batched = kernel.linear(x, tiles, 300)
    for i in range(11):
        assert torch.equal(kernel.linear(x[i:i + 1], tiles, 300), batched[i:i + 1])


def test_linear_keeps_leading_dims_and_rejects_bad_shapes() -> None:
    tiles = kernel.pack(torch.randn(63, 96).bfloat16())
    assert kernel.linear(torch.randn(2, 3, 96).bfloat16(), tiles, 63).shape == (2, 3, 63)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack(torch.randn(8, 40).bfloat16())
    with pytest.raises(RuntimeError, match="weight's dtype"):
        kernel.linear(torch.randn(1, 96), tiles, 63)
    with pytest.raises(RuntimeError, match="pack()"):
        kernel.linear(torch.randn(1, 96).bfloat16(), tiles, 70)

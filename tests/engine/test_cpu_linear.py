"""`CpuLinear` against `nn.Linear` over odd shapes, with a tolerance per dtype."""

import pytest
import torch
from torch import nn

from engine.cpu_linear import CpuLinear, optimize_for_cpu_inference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5), (16,)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(dtype: torch.dtype, shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(72, 200, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(*shape, 72, dtype=dtype)
    fast = CpuLinear(ref)
    expected = ref(x)
    got = fast(x)
    assert got.shape == expected.shape and got.dtype == dtype
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE[dtype] * scale
    assert torch.equal(fast.weight, ref.weight)


def test_optimize_swaps_every_linear_and_keeps_other_modules() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).requires_grad_(False)
    optimize_for_cpu_inference(model)
    assert isinstance(model[0], CpuLinear) and isinstance(model[2][0], CpuLinear) and isinstance(model[1], nn.ReLU)

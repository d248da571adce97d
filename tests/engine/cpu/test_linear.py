"""`CpuLinear` against `nn.Linear` over odd shapes, with a tolerance per dtype, on every kernel build
and on the paths a CPU without oneDNN bf16 or without the kernels takes."""

import pytest
import torch
from torch import nn

import specloop.engine.cpu.linear as cpu_linear
from specloop.engine.cpu.linear import SMALL_ROWS, WIDENED_ROWS, CpuLinear, CpuLmHead, optimize_for_cpu_inference
from specloop.kernels.cpu_features import CpuPlan, Isa

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ROWS = [(1, 1), (1, 7), (3, 5), (16,), (40,)]  # up to 16 rows: the kernel; 40: past every kernel limit


def check_matches(dtype: torch.dtype, shape: tuple[int, ...], bias: bool) -> CpuLinear:
    torch.manual_seed(0)
    ref = nn.Linear(96, 200, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(*shape, 96, dtype=dtype)
    fast = CpuLinear(ref)
    expected = ref(x)
    got = fast(x)
    assert got.shape == expected.shape and got.dtype == dtype
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE[dtype] * scale
    assert torch.equal(fast.weight, ref.weight)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(kernel_isa: Isa, dtype: torch.dtype, shape: tuple[int, ...], bias: bool) -> None:
    fast = check_matches(dtype, shape, bias)
    assert fast.kernel is not None and fast.kernel.isa == kernel_isa


@pytest.mark.parametrize("onednn_bf16", [False, True])
def test_kernel_rows_follow_the_bf16_path(monkeypatch: pytest.MonkeyPatch, onednn_bf16: bool) -> None:
    """Without native bf16 in oneDNN the kernel keeps bf16 passes up to WIDENED_ROWS, and nothing
    asks oneDNN for its bf16 layout (on an AVX2 CPU that call raises)."""
    monkeypatch.setattr(cpu_linear, "cpu_plan", lambda: CpuPlan(Isa.AVX2, onednn_bf16, False, "test"))
    asked = []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, _: asked.append(w) or w)
    bf16 = CpuLinear(nn.Linear(96, 8).bfloat16())
    assert bf16.kernel_rows == (SMALL_ROWS if onednn_bf16 else WIDENED_ROWS)
    assert (bf16.packed is not None) == onednn_bf16 == bool(asked)
    assert CpuLinear(nn.Linear(96, 8)).kernel_rows == SMALL_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ROWS)
def test_without_kernels_or_onednn_bf16(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                        shape: tuple[int, ...]) -> None:
    """A CPU where the kernels did not build and oneDNN has no bf16: plain `F.linear` for small
    passes, bf16 weights widened to fp32 for large ones, fp32 through the transposed weight."""
    monkeypatch.setattr(cpu_linear, "cpu_plan", lambda: CpuPlan(Isa.PORTABLE, False, False, "test"))
    monkeypatch.setattr(cpu_linear, "load", lambda: None)
    fast = check_matches(dtype, shape, bias=True)
    assert fast.kernel is None and fast.packed is None and (fast.weight_t is not None) == (dtype == torch.float32)


def test_optimize_swaps_every_linear_and_keeps_other_modules() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4))).requires_grad_(False)
    optimize_for_cpu_inference(model)
    assert isinstance(model[0], CpuLinear) and isinstance(model[2][0], CpuLinear) and isinstance(model[1], nn.ReLU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_lm_heads_rows_argmax_as_alone_whatever_the_pass(kernel_isa: Isa, dtype: torch.dtype) -> None:
    """Past the kernel's rows the head sums in another order; rows with their top two logits too close
    for that come from the kernel, so each row's greedy token is the one a one-row step gives."""
    torch.manual_seed(1)
    linear = nn.Linear(576, 512, bias=False).to(dtype).requires_grad_(False)  # SmolLM2's width
    linear.weight[0] *= 8  # token 0 leads wherever x points its way...
    linear.weight[1] = linear.weight[0]  # ...and token 1 ties it there, within rounding
    linear.weight[1, 0] += 1e-3 * linear.weight[0, 0].sign()
    head = CpuLmHead(linear)
    x = torch.randn(40, 576, dtype=dtype)  # past every kernel limit
    alone = torch.cat([head(x[i:i + 1]) for i in range(40)])  # [40, V]: the kernel's rows
    pass_ = head(x)
    top = pass_.topk(2, dim=-1).values.float()  # [40, 2]
    close = top[:, 0] - top[:, 1] <= cpu_linear._rounding_margin(top[:, 0], dtype)  # [40]
    assert close.sum() >= 5  # the rows this is about: tokens 0 and 1 within rounding of each other
    assert torch.equal(pass_[close], alone[close])  # computed again by the kernel, bit for bit
    assert torch.equal(pass_.argmax(dim=-1), alone.argmax(dim=-1))
    # What the plain layer does past the kernel's rows: not the kernel's numbers.
    assert not torch.equal(CpuLinear(linear)(x), alone)


def test_only_a_transformers_dense_lm_head_becomes_an_lm_head(tiny_llama_dir) -> None:
    from specloop.engine.loaders.load import load_model

    model = optimize_for_cpu_inference(load_model(tiny_llama_dir, torch.float32, torch.device("cpu")).model)
    heads = [name for name, m in model.named_modules() if type(m) is CpuLmHead]
    assert heads == ["lm_head"] and sum(type(m) is CpuLinear for m in model.modules()) > 0

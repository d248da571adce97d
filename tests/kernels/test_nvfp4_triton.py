"""The Triton NVFP4 matmul against the torch reference, `x.float() @ dequantize(q).T`: decode and
verify row counts, N not a multiple of the N tile, K a multiple of 16 but not of the K tile, bf16
and fp32 activations, bias, both split-K paths, exact decoding of every code and block scale, and
and the errors a caller can cause. The GPU benchmark's arithmetic is tested in tests/test_benchmarks.py.

Without a GPU the kernels run under Triton's interpreter, which has to be on before triton is first
imported: triton's own helpers (`tl.zeros`, ...) are `triton.jit` functions, decorated as it loads,
and other test modules import it earlier (transformers does). So without CUDA, and unless
TRITON_INTERPRET=1 was set for the whole run, the kernel tests here are deselected (marker
`run_in_child`, tests/conftest.py) and `test_under_the_interpreter` runs this file again in a fresh
process with it set (no conftest: the file needs none). The interpreter casts fp32 to bf16 by
truncation where a GPU rounds to nearest even, which moves bf16 outputs by a mean -2.8e-3 relative
(measured at M = 4, N = 72, K = 272), inside the 1e-2 bound.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specloop.kernels import nvfp4_triton
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize, quantize
from specloop.kernels.nvfp4_triton import MAX_ROWS, nvfp4_linear, split_k

pytestmark = pytest.mark.timeout(60)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_RUN_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.run_in_child(not KERNELS_RUN_HERE)
# N: one full 64-column tile plus 8, and three plus 8. K: 2 K tiles of 128 (fp32) plus one block, one
# of 256 (bf16) plus one; and 3 blocks, under any tile.
SHAPES = [(72, 272), (200, 48)]


def on_device(q: NVFP4Weight) -> NVFP4Weight:
    return NVFP4Weight(q.packed.to(DEVICE), q.block_scale.to(DEVICE), q.tensor_scale.to(DEVICE))


def weight(n: int, k: int, seed: int = 0) -> NVFP4Weight:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g))


def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def reference(x: torch.Tensor, q: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float().cpu() @ dequantize(q).T
    return y if bias is None else y + bias.float().cpu()


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    y = y.float().cpu().flatten()
    ref = ref.flatten()
    rel = ((y - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(y, ref, dim=0).item()
    assert rel < 1e-2 and cos > 0.999, f"relative L2 {rel:.2e}, cosine {cos:.6f}"


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 2, 16, 64])
def test_matches_the_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    q = weight(n, k)
    x = activations(m, k, dtype)
    y = nvfp4_linear(x, on_device(q))
    assert y.shape == (m, n) and y.dtype == dtype and y.device.type == DEVICE.type
    assert_close(y, reference(x, q))


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bias_and_leading_dimensions(dtype: torch.dtype) -> None:
    q = weight(200, 272)
    x = activations(6, 272, dtype).reshape(2, 3, 272)
    bias = torch.randn(200).to(dtype=dtype, device=DEVICE)
    y = nvfp4_linear(x, on_device(q), bias)
    assert y.shape == (2, 3, 200)
    assert_close(y, reference(x.reshape(6, 272), q, bias))


@kernel_test
def test_decodes_every_code_and_block_scale_exactly() -> None:
    """One-hot rows of x read single weights: every byte of codes and every E4M3 byte but NaN (0x7F,
    0xFF), subnormals and the sign bit included, against `dequantize`, bit for bit. A code times its
    block scale is exact in bf16 and tf32, and the one-hot sum adds only zeros to it."""
    n, k = 72, 272
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8)
    packed[1, :128] = torch.arange(128, 256, dtype=torch.uint8)
    e4m3 = torch.cat([torch.arange(0x7F), torch.arange(0x80, 0xFF)]).to(torch.uint8)  # [254]
    scale_bytes = e4m3[torch.randint(0, len(e4m3), (n, k // 16), generator=g)]
    scale_bytes.view(-1)[:len(e4m3)] = e4m3
    q = NVFP4Weight(packed, scale_bytes.view(torch.float8_e4m3fn), torch.tensor(3.7e-3))
    w = dequantize(q)  # [N, K]
    for start in range(0, k, MAX_ROWS):
        cols = torch.arange(start, min(start + MAX_ROWS, k))
        x = torch.nn.functional.one_hot(cols, k).float().to(DEVICE)  # [rows, K]
        assert torch.equal(nvfp4_linear(x, on_device(q)).cpu(), w[:, cols].T)


@kernel_test
@pytest.mark.parametrize("sms", [1, 2, 132])
def test_split_k_paths(sms: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 40 is one N tile; K = 560 is 5 fp32 K tiles. One SM: no split, 5 tiles in one program.
    Two: 3 splits of 2, 2 and 1 tiles (the last program's second step lies past K). 132: 5 of 1."""
    monkeypatch.setattr(nvfp4_triton, "_sm_count", lambda device: sms)
    q = on_device(weight(40, 560))
    x = activations(3, 560, torch.float32)
    y = nvfp4_linear(x, q)
    assert_close(y, reference(x, q))
    assert torch.equal(nvfp4_linear(x, q), y), "split-K must give the same bits on every run"


@pytest.mark.parametrize(("n_tiles", "k_tiles", "sms", "expected"), [
    (224, 16, 132, (1, 16)),  # Llama-8B gate/up, 14336 x 4096: 1.7 waves without splitting
    (64, 56, 132, (5, 12)),  # Llama-8B down, 4096 x 14336: 264 CTAs wanted, 320 made
    (24, 3, 132, (3, 1)),  # SmolLM2 gate/up, 1536 x 576: K runs out first
    (1, 5, 2, (3, 2)),  # test_split_k_paths with two SMs
    (1, 1, 132, (1, 1)),
])
def test_split_k(n_tiles: int, k_tiles: int, sms: int, expected: tuple[int, int]) -> None:
    assert split_k(n_tiles, k_tiles, sms) == expected


def test_no_split_is_empty() -> None:
    for n_tiles in (1, 2, 7, 64, 131, 132, 500):
        for k_tiles in range(1, 70):
            split, per = split_k(n_tiles, k_tiles, 132)
            assert 1 <= split <= k_tiles and (split - 1) * per < k_tiles <= split * per


def refusals() -> list:
    q = on_device(weight(72, 48))
    strided = torch.empty(24, 72, dtype=torch.uint8, device=DEVICE).T  # [72, 24], not contiguous
    meta = NVFP4Weight(q.packed.to("meta"), q.block_scale.to("meta"), q.tensor_scale.to("meta"))
    bias = torch.zeros(72, dtype=torch.bfloat16, device=DEVICE)
    bias_message = r"bias: expected a contiguous \[72\] torch.bfloat16"
    return [
        pytest.param({"x": activations(2, 48, torch.float16)}, "x: expected bfloat16 or float32", id="fp16"),
        pytest.param({"x": activations(2, 64, torch.bfloat16)}, r"x: expected \[\.\.\., 48\]", id="wrong K"),
        pytest.param({"x": activations(48, 2, torch.bfloat16).T}, "x: expected a contiguous last dimension",
                     id="strided K"),
        pytest.param({"x": activations(65, 48, torch.bfloat16)}, "x: expected 1 to 64 rows", id="65 rows"),
        pytest.param({"x": activations(0, 48, torch.bfloat16)}, "x: expected 1 to 64 rows", id="no rows"),
        pytest.param({"q": meta}, "q.packed: expected x's device", id="weight elsewhere"),
        pytest.param({"q": NVFP4Weight(strided, q.block_scale, q.tensor_scale)}, "q.packed: expected a contiguous",
                     id="strided weight"),
        pytest.param({"bias": bias[:71]}, bias_message, id="bias shape"),
        pytest.param({"bias": bias.float()}, bias_message, id="bias dtype"),
    ]


@kernel_test
@pytest.mark.parametrize(("change", "message"), refusals())
def test_refuses(change: dict[str, object], message: str) -> None:
    args = {"x": activations(2, 48, torch.bfloat16), "q": on_device(weight(72, 48)), "bias": None} | change
    with pytest.raises(ValueError, match=message):
        nvfp4_linear(**args)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_refuses_cpu_tensors_when_compiled() -> None:
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        nvfp4_linear(torch.zeros(1, 48), weight(72, 48))


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernel tests run in this process")
@pytest.mark.timeout(150)
def test_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", __file__]
    run = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=140, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

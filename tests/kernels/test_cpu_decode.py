"""The C++ `linear` of every kernel build this CPU runs against a float64 reference over odd row
counts, bf16 and fp32, with and without bias; and the loader: the forced build is the one that
loads, a build the CPU cannot run is refused, a failed build falls back to the eager path, a build
killed mid-compile does not hang the next, and each checkout builds in its own directory."""

import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch

import specloop.kernels.cpu_decode as cpu_decode
from specloop.kernels.cpu_decode import load
from specloop.kernels.cpu_features import CpuFeatures, Isa


@pytest.fixture
def kernel(kernel_isa: Isa) -> ModuleType:
    module = load(kernel_isa)
    assert module is not None and module.isa == kernel_isa, f"the {kernel_isa} build did not load"
    return module


# Products and sums are fp32; for bf16 the only large error is the final rounding of the output.
TOLERANCE = {torch.bfloat16: 2 ** -8, torch.float32: 1e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("shape", [(32, 7), (96, 200), (576, 960), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(kernel: ModuleType, rows: int, shape: tuple[int, int], bias: bool,
                                  dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    n_in, n_out = shape
    w = (torch.randn(n_out, n_in) * n_in ** -0.5).to(dtype)
    b = torch.randn(n_out).to(dtype) if bias else None
    x = torch.randn(rows, n_in).to(dtype)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    got = kernel.linear(x, kernel.pack(w), n_out, b)
    assert got.shape == (rows, n_out) and got.dtype == dtype
    assert (got.double() - expected).abs().max() <= TOLERANCE[dtype] * expected.abs().max() + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_do_not_depend_on_the_batch(kernel: ModuleType, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 576).to(dtype)
    x = torch.randn(11, 576).to(dtype)
    tiles = kernel.pack(w)
    batched = kernel.linear(x, tiles, 300)
    for i in range(11):
        assert torch.equal(kernel.linear(x[i:i + 1], tiles, 300), batched[i:i + 1])


def test_linear_keeps_leading_dims_and_rejects_bad_shapes(kernel: ModuleType) -> None:
    tiles = kernel.pack(torch.randn(63, 96).bfloat16())
    assert kernel.linear(torch.randn(2, 3, 96).bfloat16(), tiles, 63).shape == (2, 3, 63)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.pack(torch.randn(8, 40).bfloat16())
    with pytest.raises(RuntimeError, match="weight's dtype"):
        kernel.linear(torch.randn(1, 96), tiles, 63)
    with pytest.raises(RuntimeError, match="pack()"):
        kernel.linear(torch.randn(1, 96).bfloat16(), tiles, 70)


def test_the_forced_build_is_the_default(kernel_isa: Isa) -> None:
    assert load().isa == kernel_isa


def test_a_build_this_cpu_cannot_run_is_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    zen3 = CpuFeatures("x86_64", "AMD EPYC 7B13", frozenset({"avx", "avx2", "fma", "f16c"}))
    monkeypatch.setattr(cpu_decode, "this_cpu", lambda: zen3)
    monkeypatch.setattr(cpu_decode, "compile_module", lambda *a, **k: pytest.fail("built a build it cannot run"))
    with pytest.raises(ValueError, match="avx512_bf16 build of the CPU kernels cannot run on this CPU"):
        load(Isa.AVX512_BF16)


def test_a_failed_build_warns_and_leaves_the_eager_path(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(*args: object, **kwargs: object) -> ModuleType:
        raise OSError("c++: not found")

    monkeypatch.setattr(cpu_decode, "compile_module", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specloop.kernels.cpu_decode"):
        assert cpu_decode._build.__wrapped__(Isa.PORTABLE) is None
    assert "CPU decode kernels (portable) unavailable, using the eager path: c++: not found" in caplog.text


# A module without torch's headers, so that the build under test takes a second rather than 40.
PROBE_SOURCE = """
#include <Python.h>
static PyModuleDef probe = {PyModuleDef_HEAD_INIT, "specloop_lock_probe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_specloop_lock_probe() { return PyModule_Create(&probe); }
"""


@pytest.mark.timeout(180)
def test_a_build_killed_mid_compile_does_not_hang_the_next(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()  # what torch's builder leaves when its process is killed while compiling
    with caplog.at_level(logging.WARNING, logger="specloop.kernels.cpu_decode"):
        module = cpu_decode.compile_module("specloop_lock_probe", source, Isa.PORTABLE, build)
    assert module.__name__ == "specloop_lock_probe"
    assert "left by a kernel build that did not finish" in caplog.text
    assert not (build / "lock").exists()


def test_each_checkout_builds_in_a_directory_of_its_own(tmp_path: Path) -> None:
    here = cpu_decode.default_build_directory("specloop_cpu_decode_avx2", cpu_decode.SOURCE)
    copy = cpu_decode.default_build_directory("specloop_cpu_decode_avx2", tmp_path / "kernels" / "cpu_decode.cpp")
    assert here != copy and here.parent == copy.parent
    assert here.name.startswith("specloop_cpu_decode_avx2-")
    assert here == cpu_decode.default_build_directory("specloop_cpu_decode_avx2", cpu_decode.SOURCE)

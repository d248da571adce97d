"""Every benchmark script starts as its docstring says to run it (`python benchmarks/<name>.py`): its
imports resolve from a checkout and its options parse. Measuring is the scripts' own business, except
the arithmetic of the GPU benchmark (`benchmarks/nvfp4_gpu.py`), which cannot run here."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import nvfp4_gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_script_starts(script: Path) -> None:
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT / "benchmarks", capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 8, SCRIPTS


def test_gpu_benchmark_arithmetic() -> None:
    # SmolLM2's 1536 x 576: 1769472 bytes in bf16, 442368 of codes + 55296 of block scales in NVFP4
    assert nvfp4_gpu.weight_bytes(1536, 576, "bf16") == 1769472
    assert nvfp4_gpu.weight_bytes(1536, 576, "nvfp4") == 442368 + 55296
    assert nvfp4_gpu.weight_bytes(1536, 576, "bf16") / nvfp4_gpu.weight_bytes(1536, 576, "nvfp4") == nvfp4_gpu.CEILING
    assert nvfp4_gpu.fraction_of_ceiling(bf16_us=32.0, nvfp4_us=10.0) == pytest.approx(0.9)
    assert nvfp4_gpu.flush_bytes(50 << 20) > 50 << 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark measures")
def test_gpu_benchmark_skips_without_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["nvfp4_gpu.py", "--out", str(tmp_path / "out.json")])
    nvfp4_gpu.main()
    assert capsys.readouterr().out.startswith("skip: no CUDA GPU")
    assert not (tmp_path / "out.json").exists()

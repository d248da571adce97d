"""Every benchmark script starts as its docstring says to run it (`python benchmarks/<name>.py`): its
imports resolve from a checkout and its options parse. Measuring is the scripts' own business."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_script_starts(script: Path) -> None:
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT / "benchmarks", capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 8, SCRIPTS

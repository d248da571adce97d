"""specloop as a user installs it: a wheel built from the source tree, installed (not editable) into a
new venv beside Hugging Face's `kernels`, used from a directory outside the checkout.

The wheel holds one top-level import name, `specloop`, and the package data `specloop up` needs: the
retrain policies, the demo's prompts, the shipped drafter and the kernel sources. The new venv gets
its dependencies from this one's site-packages (a `.pth` line, not a second multi-GB install); they
come after its own site-packages, so `specloop` is the wheel's and this venv's editable install,
whose finder only its own `.pth` switches on, plays no part.
"""

import os
import re
import shutil
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import wait_ready
from specloop.storage.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "engine", "kernels", "consent", "storage", "daemon")
PACKAGE_DATA = ("specloop/daemon/policies/demo.yaml", "specloop/daemon/policies/default.yaml",
                "specloop/daemon/training/prompt_sets/formal-logic.jsonl",
                "specloop/daemon/drafters/SmolLM2-135M-Instruct/model.safetensors",
                "specloop/kernels/cpu_decode.cpp", "specloop/kernels/simd.h")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what the Dockerfile copies (so a stray build/ stays out of the tree)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), str(source)], check=True, timeout=240)
    [built] = dist.glob("specloop-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv holding the wheel, with this venv's site-packages after its own."""
    home = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True, timeout=120)
    [own] = home.glob("lib/python3.*/site-packages")
    (own / "dependencies.pth").write_text(site.getsitepackages()[0] + "\n")
    # --ignore-installed: where the outer venv holds specloop as a wheel too (make test-latest), pip
    # would find it through the .pth line and install nothing.
    subprocess.run([str(home / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--ignore-installed", str(wheel)], check=True, timeout=120)
    return home


def test_the_wheel_holds_one_import_name_and_the_package_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"specloop", wheel.name.split("-py3")[0] + ".dist-info"}
    assert set(PACKAGE_DATA) <= set(names)


def test_hugging_faces_kernels_and_ours_are_two_packages(venv: Path, tmp_path: Path) -> None:
    printed = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import kernels, specloop.kernels; print(kernels.__file__); "
                              "print(specloop.kernels.__file__)"],
                             cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60).stdout.split()
    theirs, ours = map(Path, printed)
    assert theirs.parent == Path(site.getsitepackages()[0]) / "kernels"
    assert ours.parent.parts[-2:] == ("specloop", "kernels") and ours.is_relative_to(venv)


def test_up_serves_from_outside_the_checkout(venv: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`specloop up` with the retraining daemon (its policy is package data) from an empty directory."""
    run_in = tmp_path / "elsewhere"
    run_in.mkdir()
    env = {**os.environ, "SPECLOOP_DTYPE": "float32", "SPECLOOP_DEVICE": "cpu", "SPECLOOP_MAX_LEN": "256",
           "SPECLOOP_NUM_SLOTS": "2"}
    port, log = free_port(), tmp_path / "up.log"
    command = [str(venv / "bin" / "specloop"), "up", "--model", str(tiny_llama_dir), "--port", str(port),
               "--mlflow-port", "0", "--daemon-port", "0"]
    with open(log, "wb") as out:
        up = subprocess.Popen(command, cwd=run_in, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, up, log, 300)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == tiny_llama_dir.name
        policy = re.search(r"retraining daemon \(policy (\S+)\)", log.read_text())
        assert policy and Path(policy[1]).is_relative_to(venv), log.read_text()
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert (run_in / "data" / "registry").is_dir()  # the relative defaults resolve where it was started

"""Root fixtures shared by every test package: a run per CPU kernel build, and the embedded
Kafka-compatible broker.

Kernel tests run once per build of the C++ CPU kernels that this CPU can execute (`kernel_isa`):
an AVX-512 BF16 machine tests its own, the AVX2 and the portable build; with `SPECLOOP_CPU_ISA`
set, only the builds at or below it. `x86_kernels` gives a test all the x86 builds at once.
Every build is compiled here, outside every test's timeout,
all at once (on a clean cache about 35 s each alone, 40 s for two together on 2 cores).

Tests run torch on one thread: with two OpenMP threads a tiny model's matmuls slowed 16x (62 s vs
3.8 s for the same test) whenever another process loaded the 2 cores, because the threads spin at
every barrier. Benchmarks, not tests, measure multi-threaded speed. `make test` runs two pytest-xdist
workers, so both cores work (the Makefile); each worker has its own session fixtures (broker, models).

Tests import specloop as installed (`specloop.*`), never from the checkout's root: pytest runs in
`importlib` mode (pyproject.toml), which puts no folder on `sys.path`, so the checkout's `kernels/`
cannot shadow Hugging Face's `kernels`, which transformers imports. pytest itself makes `tests`
importable; `benchmarks` (scripts, not installed), whose helpers some tests use, is registered here
by its path alone.

`broker` is one tansu process with memory storage for the whole session (fast; a restart would
lose everything, so tests that restart use `durable_broker`). `durable_broker` is a fresh tansu on
S3 storage against a moto server on loopback, per test, which keeps topics, records and committed
offsets across `restart()`. Both are real processes and are always stopped.
"""

import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import torch

from specloop.kernels.cpu_decode import cpu_plan, load, this_cpu
from specloop.kernels.cpu_features import FORCE_VARIABLE, Isa, runnable
from specloop.storage.broker import EmbeddedBroker, LocalS3

pytest_plugins = ["tests.model_fixtures"]


def _register_benchmarks() -> None:
    """`benchmarks` as a namespace package over the checkout's benchmarks/ folder, and nothing else."""
    spec = importlib.machinery.ModuleSpec("benchmarks", None, is_package=True)
    spec.submodule_search_locations = [str(Path(__file__).resolve().parents[1] / "benchmarks")]
    sys.modules.setdefault("benchmarks", importlib.util.module_from_spec(spec))


_register_benchmarks()

torch.set_num_threads(1)
KERNEL_ISAS = runnable(this_cpu(), ceiling=cpu_plan().isa)
with ThreadPoolExecutor(len(KERNEL_ISAS)) as _builds:  # each build is one compiler process
    list(_builds.map(load, KERNEL_ISAS))


@pytest.fixture(params=KERNEL_ISAS, ids=str)
def kernel_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Isa]:
    """The test runs once per kernel build: `load()`, and every model optimised for the CPU while it
    runs, use that build and decide the rest as a CPU whose best build it is would."""
    monkeypatch.setenv(FORCE_VARIABLE, request.param)
    cpu_plan.cache_clear()
    yield request.param
    cpu_plan.cache_clear()


@pytest.fixture
def x86_kernels() -> list[ModuleType]:
    """Every x86 build of the kernels this CPU can execute (an AVX-512 BF16 machine: that build and
    AVX2), for tests that compare them, whatever `SPECLOOP_CPU_ISA` caps: they test the builds, not
    the paths a capped process picks, so they run in `make test-avx2` too. On a CPU without AVX-512
    BF16 there is no second x86 build to run, and such a test is skipped, as a GPU kernel's on a CPU."""
    builds = [load(isa) for isa in runnable(this_cpu()) if isa != Isa.PORTABLE]
    assert all(build is not None for build in builds), "an x86 build of the kernels did not load"
    if len(builds) < 2:
        pytest.skip("the AVX-512 BF16 build cannot execute on this CPU: no second x86 build to compare with AVX2")
    return builds


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with open(log, "wb") as handle, EmbeddedBroker(log=handle) as running:
        yield running


@pytest.fixture
def durable_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    with open(tmp_path / "moto.log", "wb") as moto_log, open(tmp_path / "tansu.log", "wb") as log:
        with LocalS3(log=moto_log) as s3, EmbeddedBroker(s3=s3, log=log) as running:
            yield running


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `run_in_child(True)` run in a child process that another test starts (the Triton
    kernels under the interpreter, tests/kernels/test_nvfp4_triton.py): they are deselected here
    rather than skipped, so a skip in the summary always means something did not run."""
    elsewhere = [item for item in items if (mark := item.get_closest_marker("run_in_child")) and mark.args[0]]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if item not in elsewhere]

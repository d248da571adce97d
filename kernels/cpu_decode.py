"""Builds and loads the C++ CPU decode kernels (`cpu_decode.cpp`), one build per instruction set.

The same source is compiled once for each path in `kernels/cpu_features.py` (AVX-512 BF16, AVX2 +
FMA, portable), with that path's flags and its vector layer (`simd_<isa>.h`), as its own module
`specloop_cpu_decode_<isa>`. torch's extension builder compiles with ninja into its per-user cache
on first use (about 40 s per build here), in a directory of its own per checkout, and reuses a
build while the source, headers and flags are unchanged. Builds carry their instruction set in
their name, and only a build this CPU can run is ever loaded, so a cache shared between machines
never hands an AVX-512 build to an AVX2 CPU. A build runs under an OS file lock (`_build_lock`), so
one killed mid-compile cannot hang later starts. It links OpenMP so that `at::parallel_for` runs on
torch's own thread pool (both load the `libgomp.so.1` torch ships).

This file only builds and loads; which build this process uses is `cpu_plan()` (logged once), and
when to use the kernels is `engine/cpu/fused_decode.py`'s and `engine/cpu/linear.py`'s business. Where
a build fails (no compiler) everything runs on the eager path, after one warning.
"""

import contextlib
import fcntl
import functools
import hashlib
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from specloop.kernels.cpu_features import CpuFeatures, CpuPlan, Isa, forced_isa, plan, runnable

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# No -march=native: a build must run on every CPU that has its flags, not only on the one it was built on.
ISA_FLAGS = {
    Isa.AVX512_BF16: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                      "-mfma", "-mf16c", "-DSPECLOOP_AVX512_BF16"],
    Isa.AVX2: ["-mavx2", "-mfma", "-mf16c", "-DSPECLOOP_AVX2"],
    Isa.PORTABLE: [],
}


@functools.cache
def this_cpu() -> CpuFeatures:
    """This machine's CPU, read once."""
    return CpuFeatures.detect()


@functools.cache
def cpu_plan() -> CpuPlan:
    """This process's CPU paths (`kernels/cpu_features.py`), decided and logged once."""
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    chosen = plan(this_cpu(), forced_isa(), onednn_bf16)
    log.info("CPU paths: %s", chosen.reason)
    return chosen


def load(isa: Isa | None = None) -> ModuleType | None:
    """The compiled module (`linear`, `pack`, `Decoder`, `isa`) for `isa`, by default this process's
    planned build; None where it cannot be built here. A build this CPU cannot run is refused."""
    isa = cpu_plan().isa if isa is None else isa
    if isa not in runnable(this_cpu()):
        raise ValueError(f"the {isa} build of the CPU kernels cannot run on this CPU ({this_cpu().model})")
    return _build(isa)


@functools.cache
def _build(isa: Isa) -> ModuleType | None:
    try:
        module = compile_module(f"specloop_cpu_decode_{isa}", SOURCE, isa)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("CPU decode kernels (%s) unavailable, using the eager path: %s", isa, e)
        return None
    assert module.isa == isa, f"module built for {isa} reports {module.isa}"
    return module


def compile_module(name: str, source: Path, isa: Isa, build_directory: Path | None = None) -> ModuleType:
    """Build (or reuse the cached build of) a kernel source as module `name` for `isa`. `load` uses
    it for this checkout's kernels; `benchmarks/verify_pass.py` for an older revision's. The
    headers' digest is a flag, so a header edit rebuilds (torch hashes only the sources)."""
    from torch.utils.cpp_extension import load as build

    digest = hashlib.sha256(b"".join(h.read_bytes() for h in sorted(source.parent.glob("simd*.h")))).hexdigest()
    flags = ["-O3", "-fopenmp", f"-DSPECLOOP_HEADERS={digest[:16]}", *ISA_FLAGS[isa]]
    directory = build_directory or default_build_directory(name, source)
    with _build_lock(directory):
        return build(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                     build_directory=str(directory))


def default_build_directory(name: str, source: Path) -> Path:
    """Where `name` from `source` is built in torch's per-user cache: one directory per checkout.

    ninja rebuilds whenever the source's path in its build file changes, so two checkouts sharing one
    directory (a working tree and a copy a long run starts from) rebuilt each other's kernels on every
    start, 40 s of both cores each time.
    """
    from torch.utils.cpp_extension import _get_build_directory  # the builder has no public way to it

    checkout = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    return Path(_get_build_directory(f"{name}-{checkout}", verbose=False))


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold an OS lock on a build directory and clear a dead build's marker from it.

    torch's builder marks a build in progress with a plain file, `lock`, and waits without limit while
    one exists: a build killed mid-compile (here a `timeout` around a first `pytest` on a busy CPU)
    left one, and every later start hung at import with no message. The kernel releases a `flock` when
    its process dies, and every specloop build of the directory takes it first, so a `lock` file
    found while holding it is a dead build's.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "specloop.flock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        marker = directory / "lock"
        if marker.exists():
            log.warning("removing %s, left by a kernel build that did not finish", marker)
            marker.unlink()
        yield

"""Builds and loads the C++ CPU decode kernels (`cpu_decode.cpp`) once per machine.

torch's extension builder compiles the source with ninja into its per-user cache on first use
(about 40 s here) and reuses the build while the source is unchanged. It links OpenMP so that
`at::parallel_for` runs on torch's own thread pool (both load the `libgomp.so.1` torch ships).

This file only decides whether the kernels can exist on this machine and loads them; when to use
them is `engine/fused_decode.py`'s and `engine/cpu_linear.py`'s business. Where they cannot be built
(no AVX-512 BF16, no compiler) everything runs on the eager path, after one warning.
"""

import functools
import logging
import subprocess
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]


def cpu_has_avx512_bf16() -> bool:
    """True on x86 CPUs with the AVX-512 BF16 dot-product instruction (Linux's `avx512_bf16` flag)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any("avx512_bf16" in line.split() for line in text.splitlines() if line.startswith("flags"))


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (`linear`, `Decoder`), or None where this machine cannot build or run it."""
    if not torch.backends.mkldnn.is_available() or not cpu_has_avx512_bf16():
        return None
    try:
        return compile_module("specloop_cpu_decode", SOURCE)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        log.warning("CPU decode kernels unavailable, using the eager path: %s", e)
        return None


def compile_module(name: str, source: Path, build_directory: Path | None = None) -> ModuleType:
    """Build (or reuse the cached build of) a kernel source as module `name`, with the flags above.
    `load` uses it for this checkout's kernels; `benchmarks/verify_pass.py` for an older revision's."""
    from torch.utils.cpp_extension import load as build

    return build(name, [str(source)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=None if build_directory is None else str(build_directory))

"""Where a benchmark ran, for its JSON: the CPU (its x86 family and model tell a Zen 3 from a Zen 4),
how fast it reads memory, the paths our kernels took on it, torch's own dispatch level, and
llama.cpp's build when it is installed. Figures from different CPUs are not comparable; this says
which CPU a figure belongs to.

Not a benchmark itself, and it decides nothing: the CPU paths are `specloop.kernels.cpu_decode.cpu_plan()`.
"""

import importlib.util
import os
import time

import torch

from specloop.kernels.cpu_decode import cpu_plan, this_cpu
from specloop.kernels.cpu_features import FORCE_VARIABLE


def describe() -> dict[str, object]:
    cpu, chosen = this_cpu(), cpu_plan()
    return {
        "cpu": cpu.model,
        "cpu_family_model": cpu.family_model,
        "arch": cpu.machine,
        "memory_read_gb_s": read_bandwidth_gb_s(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kernel_isa": str(chosen.isa),
        "onednn_bf16": chosen.onednn_bf16,
        "cpu_paths": chosen.reason,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Set when a run stands in for a lower CPU (SPECLOOP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2
        # ONEDNN_MAX_CPU_ISA=AVX2): every system in it then dispatches as on that CPU.
        "forced": {k: os.environ[k] for k in (FORCE_VARIABLE, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                   if k in os.environ},
        "llama_cpp": llama_cpp_build(),
    }


def llama_cpp_build() -> dict[str, str] | None:
    """llama-cpp-python's version and the instruction sets its build uses, or None when absent."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def read_bandwidth_gb_s(megabytes: int = 256, rounds: int = 5) -> float:
    """GB/s this machine reads with torch's threads: the best of `rounds` sums of a tensor far larger
    than the caches. Decoding at batch 1 reads every weight once per token, so this over the bytes a
    token reads bounds its tok/s. Machines of one kind differ: a Zen 3 EPYC VM here read 13-15 GB/s
    where another had been reported copying about 24 GB/s."""
    x = torch.ones(megabytes << 18)  # fp32
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return round(x.numel() * 4 / best / 1e9, 1)

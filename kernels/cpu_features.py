"""What this CPU can run: which build of the C++ decode kernels, and whether bf16 matrices go to
oneDNN's bf16 path or are computed in fp32 from bf16 weights.

The decisions are pure functions of a `CpuFeatures` value, so a test can hand in a CPU that lacks
a feature and see the fallback; `CpuFeatures.detect()` reads the real one (Linux's /proc/cpuinfo
flags, which list only what the kernel has enabled). Nothing here builds or loads anything
(`kernels/cpu_decode.py`) or decides which pass runs where (`engine/cpu/linear.py`).

`SPECLOOP_CPU_ISA` lowers the ceiling: `avx2` on an AVX-512 machine chooses everything as an
AVX2-only CPU would (the C++ kernels' AVX2 build, no oneDNN bf16), which is how tests and CI run
the lower paths on any machine. A path the CPU cannot run is refused, never loaded.
"""

import os
import platform
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

FORCE_VARIABLE = "SPECLOOP_CPU_ISA"


class Isa(StrEnum):
    """The kernels' builds, best first (each one's vector layer is `kernels/simd_<name>.h`)."""

    AVX512_BF16 = "avx512_bf16"
    AVX2 = "avx2"
    PORTABLE = "portable"


# Linux cpuinfo flags each x86 build needs; the portable build needs nothing.
REQUIRED_FLAGS = {
    Isa.AVX512_BF16: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                                   "fma", "avx2", "f16c"}),
    Isa.AVX2: frozenset({"avx2", "fma", "f16c"}),
    Isa.PORTABLE: frozenset(),
}
_X86 = ("x86_64", "amd64", "i686", "i386")


@dataclass(frozen=True)
class CpuFeatures:
    machine: str  # platform.machine(): x86_64, aarch64, arm64, ...
    model: str  # e.g. "AMD EPYC 7B13"; "unknown" where the OS does not say
    flags: frozenset[str]  # x86 cpuinfo flags (avx2, avx512_bf16, ...), or arm Features
    # x86 "family/model" (25/1 is AMD Zen 3, 25/17 Zen 4, 6/106 Intel Ice Lake server), or None: VMs
    # often name the CPU only "AMD EPYC". For the benchmarks' records; nothing is decided by it.
    family_model: str | None = None

    @property
    def x86(self) -> bool:
        return self.machine.lower() in _X86

    @classmethod
    def detect(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> "CpuFeatures":
        try:
            text = cpuinfo.read_text()
        except OSError:
            text = ""
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
        flags = fields.get("flags") or fields.get("features") or ""
        model = fields.get("model name") or fields.get("hardware") or platform.processor() or "unknown"
        family, number = fields.get("cpu family"), fields.get("model")
        return cls(platform.machine(), model, frozenset(flags.split()),
                   f"{family}/{number}" if family and number else None)


def runnable(cpu: CpuFeatures, ceiling: Isa | None = None) -> list[Isa]:
    """The builds this CPU can execute (those at or below `ceiling` when given), best first; always
    ends with the portable one."""
    order = list(Isa)
    lowest = order.index(ceiling) if ceiling is not None else 0
    return [isa for isa in order[lowest:] if isa is Isa.PORTABLE or (cpu.x86 and REQUIRED_FLAGS[isa] <= cpu.flags)]


def choose(cpu: CpuFeatures, forced: str | None = None) -> Isa:
    """The best build this CPU runs, or `forced` (a `SPECLOOP_CPU_ISA` value) when it can run that."""
    paths = runnable(cpu)
    if not forced:
        return paths[0]
    try:
        isa = Isa(forced.strip().lower())
    except ValueError:
        raise ValueError(f"{FORCE_VARIABLE}: unknown instruction set {forced!r}; "
                         f"use one of {', '.join(Isa)}") from None
    if isa not in paths:
        missing = sorted(REQUIRED_FLAGS[isa] - cpu.flags) if cpu.x86 else [f"an x86 CPU, not {cpu.machine}"]
        raise ValueError(f"{FORCE_VARIABLE}={isa}: this CPU cannot run it (it lacks {', '.join(missing)}); "
                         f"it can run {', '.join(paths)}")
    return isa


@dataclass(frozen=True)
class CpuPlan:
    """Which CPU paths this process takes, and one line saying which and why."""

    isa: Isa  # the C++ kernels' build
    onednn_bf16: bool  # bf16 matrices past the kernel's rows run in oneDNN's bf16 path (else fp32)
    dense_gguf_prefill: bool  # GGUF prefill chunks multiply a bf16 weight dequantized per pass (else int8 rows)
    reason: str


def plan(cpu: CpuFeatures, forced: str | None, onednn_bf16_supported: bool) -> CpuPlan:
    """Decide the CPU paths. `onednn_bf16_supported` is torch's own check
    (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`), which also passes on AVX-512 CPUs without bf16
    dot products: there oneDNN emulates them, and a 512-row bf16 matrix product ran 4-5x slower
    than fp32 from the same weights (576 x 3072: 30.6 vs 7.1 ms, Xeon Ice Lake, 2 cores). So oneDNN
    bf16 is taken only where the kernels' AVX-512 BF16 build is.

    A GGUF prefill chunk multiplies a bf16 weight dequantized for the pass only where oneDNN has AMX:
    on the AMX Xeon that took a 240-token prefill from 460.8 to 124.8 ms (the 4-row kernel of then),
    but on a Zen 4 (AVX-512 BF16, no AMX) the VNNI kernel's int8 rows took 0.27-0.62x the time of
    dequantizing and oneDNN's bf16 product at 65 to 512 rows of one 3072 x 576 matrix
    (docs/performance.md, "GGUF weights at their own bits")."""
    isa = choose(cpu, forced)
    best = runnable(cpu)[0]
    if isa is not best:
        why = f"{FORCE_VARIABLE}={forced}, below this CPU's {best}"
    elif isa is Isa.AVX512_BF16:
        why = "the CPU has AVX-512 BF16"
    elif cpu.x86:
        lacking = sorted(REQUIRED_FLAGS[Isa.AVX512_BF16] - cpu.flags)
        why = f"the CPU lacks {', '.join(lacking)}" + (" and avx2/fma/f16c" if isa is Isa.PORTABLE else "")
    else:
        why = f"no vector build for {cpu.machine}; the compiler vectorises for it"
    onednn = onednn_bf16_supported and isa is Isa.AVX512_BF16
    matrices = "oneDNN bf16" if onednn else "fp32 from the bf16 weights (no native bf16 dot products)"
    dense_prefill = onednn and "amx_bf16" in cpu.flags
    prefill = "AMX bf16 from weights dequantized per pass" if dense_prefill else "the kernel's int8 rows"
    return CpuPlan(isa, onednn, dense_prefill, f"{cpu.model} ({cpu.machine}): C++ kernels {isa} ({why}); "
                                               f"large bf16 matrix products in {matrices}; GGUF prefill on {prefill}")


def forced_isa() -> str | None:
    """The `SPECLOOP_CPU_ISA` ceiling, if set."""
    return os.environ.get(FORCE_VARIABLE) or None

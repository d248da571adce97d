"""The CPU-capability decisions on CPUs this machine is not: each one that lacks a feature gets the
next path, a forced path lowers the ceiling and is refused where the CPU cannot run it."""

from pathlib import Path

import pytest

from specloop.kernels.cpu_features import FORCE_VARIABLE, CpuFeatures, Isa, choose, plan, runnable

BASE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt"}
AVX2 = BASE | {"avx", "avx2", "fma", "f16c", "bmi2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
ZEN3 = CpuFeatures("x86_64", "AMD EPYC 7B13", frozenset(AVX2))
ICE_LAKE = CpuFeatures("x86_64", "Intel Xeon Ice Lake", frozenset(AVX512))
ZEN4 = CpuFeatures("x86_64", "AMD EPYC 9B14", frozenset(AVX512 | {"avx512_bf16"}))
OLD_X86 = CpuFeatures("x86_64", "Intel Core 2", frozenset(BASE))
GRAVITON = CpuFeatures("aarch64", "unknown", frozenset({"fp", "asimd", "bf16", "sve"}))


@pytest.mark.parametrize(("cpu", "expected"), [
    (ZEN4, [Isa.AVX512_BF16, Isa.AVX2, Isa.PORTABLE]),
    (ICE_LAKE, [Isa.AVX2, Isa.PORTABLE]),
    (ZEN3, [Isa.AVX2, Isa.PORTABLE]),
    (OLD_X86, [Isa.PORTABLE]),
    (GRAVITON, [Isa.PORTABLE]),
    (CpuFeatures("x86_64", "AVX2 without FMA", frozenset(BASE | {"avx", "avx2", "f16c"})), [Isa.PORTABLE]),
])
def test_runnable_builds_best_first(cpu: CpuFeatures, expected: list[Isa]) -> None:
    assert runnable(cpu) == expected
    assert choose(cpu) == expected[0]


def test_a_ceiling_keeps_the_builds_below_it() -> None:
    assert runnable(ZEN4, ceiling=Isa.AVX2) == [Isa.AVX2, Isa.PORTABLE]
    assert runnable(ZEN3, ceiling=Isa.AVX512_BF16) == [Isa.AVX2, Isa.PORTABLE]
    assert runnable(ZEN4, ceiling=Isa.PORTABLE) == [Isa.PORTABLE]


def test_onednn_bf16_only_with_native_bf16_dot_products() -> None:
    assert plan(ZEN4, None, onednn_bf16_supported=True).onednn_bf16
    assert not plan(ZEN4, None, onednn_bf16_supported=False).onednn_bf16
    # torch says yes on AVX-512 without BF16 (oneDNN emulates it, 4-5x slower than fp32): not taken.
    ice = plan(ICE_LAKE, None, onednn_bf16_supported=True)
    assert ice.isa is Isa.AVX2 and not ice.onednn_bf16 and "lacks avx512_bf16" in ice.reason
    zen3 = plan(ZEN3, None, onednn_bf16_supported=False)
    assert zen3.isa is Isa.AVX2 and not zen3.onednn_bf16
    assert "fp32 from the bf16 weights" in zen3.reason and "AMD EPYC 7B13" in zen3.reason


def test_gguf_prefill_is_dense_only_on_amx() -> None:
    zen4 = plan(ZEN4, None, onednn_bf16_supported=True)
    assert zen4.onednn_bf16 and not zen4.dense_gguf_prefill and "GGUF prefill on the kernel's int8 rows" in zen4.reason
    amx = CpuFeatures("x86_64", "Intel Xeon Sapphire Rapids", ZEN4.flags | {"amx_bf16", "amx_tile"})
    assert plan(amx, None, onednn_bf16_supported=True).dense_gguf_prefill
    assert not plan(amx, None, onednn_bf16_supported=False).dense_gguf_prefill
    assert not plan(amx, "avx2", onednn_bf16_supported=True).dense_gguf_prefill


def test_forcing_a_lower_path_acts_as_that_cpu() -> None:
    forced = plan(ZEN4, "avx2", onednn_bf16_supported=True)
    assert forced.isa is Isa.AVX2 and not forced.onednn_bf16
    assert f"{FORCE_VARIABLE}=avx2" in forced.reason
    assert plan(ZEN3, " AVX2 ", onednn_bf16_supported=False).isa is Isa.AVX2
    assert plan(ZEN4, "portable", onednn_bf16_supported=True).isa is Isa.PORTABLE


def test_forcing_what_the_cpu_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="avx512_bf16: this CPU cannot run it.*lacks avx512_bf16"):
        choose(ICE_LAKE, "avx512_bf16")
    with pytest.raises(ValueError, match="lacks avx512_bf16, avx512_vnni, avx512bw, avx512dq, avx512f, avx512vl"):
        choose(ZEN3, "avx512_bf16")
    with pytest.raises(ValueError, match="an x86 CPU, not aarch64"):
        choose(GRAVITON, "avx2")
    with pytest.raises(ValueError, match=f"{FORCE_VARIABLE}: unknown instruction set 'sse9'"):
        choose(ZEN4, "sse9")


def test_without_vector_builds_the_reason_says_so() -> None:
    assert "no vector build for aarch64" in plan(GRAVITON, None, onednn_bf16_supported=False).reason
    assert "and avx2/fma/f16c" in plan(OLD_X86, None, onednn_bf16_supported=False).reason


def test_detect_reads_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
                   "flags\t\t: fpu sse2 avx avx2 fma f16c\n\nprocessor\t: 1\nmodel name\t: other\n")
    cpu = CpuFeatures.detect(x86)
    assert cpu.model == "AMD EPYC 7B13 64-Core Processor" and {"avx2", "fma", "f16c"} <= cpu.flags
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm bf16\n")
    assert CpuFeatures.detect(arm).flags == {"fp", "asimd", "evtstrm", "bf16"}
    missing = CpuFeatures.detect(tmp_path / "absent")
    assert missing.flags == frozenset() and runnable(missing)[-1] is Isa.PORTABLE


def test_detect_reads_the_x86_family_and_model(tmp_path: Path) -> None:
    zen3 = tmp_path / "zen3"
    zen3.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
                    "model name\t: AMD EPYC\nflags\t\t: avx2 fma f16c\n")
    assert CpuFeatures.detect(zen3).family_model == "25/1"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert CpuFeatures.detect(arm).family_model is None

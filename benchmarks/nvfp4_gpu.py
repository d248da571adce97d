"""NVFP4 Triton kernel against a bf16 matmul on a CUDA GPU, at decode shapes, L2 flushed.

Decode is bound by streaming weights, so the NVFP4 kernel (`kernels/nvfp4_triton.py`) can be at
most 16/4.5 = 3.56x faster than torch's bf16 `F.linear` on the same weights; this reports the
speed-up and its fraction of that ceiling (target >= 85%; Marlin's INT4 reached about 80% of its
own). Layers: SmolLM2-135M's MLP (576 <-> 1536) and Llama-3-8B's (4096 <-> 14336), both directions,
at 1, 4 and 16 rows. Before every timed call a buffer twice the L2 is overwritten, so each call
reads its weights from memory as a decode step does; times are CUDA events around the one call,
the median of `--repeats`. Each cell also checks the kernel against `x.float() @ dequantize(q).T`.

Writes `benchmarks/results/nvfp4_gpu.json` and prints a markdown table. Run on a GPU:
`.venv/bin/python benchmarks/nvfp4_gpu.py` (about a minute). Without one it says so and exits 0,
writing nothing. This is not a test: it asserts nothing.
"""

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from specloop.kernels.nvfp4 import BLOCK, dequantize, quantize
from specloop.kernels.nvfp4_triton import nvfp4_linear

RESULTS = Path(__file__).parent / "results" / "nvfp4_gpu.json"
CEILING = 16 / 4.5  # bf16 bits per weight over NVFP4's: 4-bit codes plus an 8-bit scale per 16
TARGET_FRACTION = 0.85
LAYERS = {  # name: (N, K) of the weight
    "smollm2.gate_up": (1536, 576),
    "smollm2.down": (576, 1536),
    "llama8b.gate_up": (14336, 4096),
    "llama8b.down": (4096, 14336),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="activation rows M")
    p.add_argument("--repeats", type=int, default=100, help="timed calls per cell (the median is reported)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def weight_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes a matmul streams for an `[N, K]` weight: bf16, or NVFP4's codes and block scales."""
    return {"bf16": 2 * n * k, "nvfp4": n * k // 2 + n * k // BLOCK}[fmt]


def fraction_of_ceiling(bf16_us: float, nvfp4_us: float) -> float:
    return bf16_us / nvfp4_us / CEILING


def flush_bytes(l2_bytes: int) -> int:
    """A write this large leaves none of the previous call's data in an L2 of `l2_bytes`."""
    return 2 * l2_bytes


def median_us(fn: Callable[[], object], flush: torch.Tensor, repeats: int) -> float:
    """Median GPU time of `fn()` in microseconds, L2 flushed before each call."""
    for _ in range(3):  # compiles Triton kernels, warms cuBLAS's heuristics
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def measure(name: str, n: int, k: int, rows: int, flush: torch.Tensor, repeats: int) -> dict[str, object]:
    torch.manual_seed(0)
    q = quantize(torch.randn(n, k, device="cuda"))
    w = dequantize(q)  # [N, K] fp32, the weights both sides compute with
    w_bf16 = w.bfloat16()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.T
    rel_l2 = ((nvfp4_linear(x, q).float() - ref).norm() / ref.norm()).item()
    bf16_us = median_us(lambda: F.linear(x, w_bf16), flush, repeats)
    nvfp4_us = median_us(lambda: nvfp4_linear(x, q), flush, repeats)
    return {
        "layer": name, "n": n, "k": k, "rows": rows,
        "bf16_us": bf16_us, "nvfp4_us": nvfp4_us,
        "speedup": bf16_us / nvfp4_us, "fraction_of_ceiling": fraction_of_ceiling(bf16_us, nvfp4_us),
        "bf16_gb_per_s": weight_bytes(n, k, "bf16") / bf16_us / 1e3,
        "nvfp4_gb_per_s": weight_bytes(n, k, "nvfp4") / nvfp4_us / 1e3,
        "relative_l2_vs_reference": rel_l2,
    }


def device() -> dict[str, object]:
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "l2_bytes": props.L2_cache_size, "memory_bytes": props.total_memory, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__}


def markdown_table(cells: list[dict]) -> str:
    lines = ["| layer | N x K | rows | bf16 us | NVFP4 us | speed-up | of 3.56x | NVFP4 GB/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {c['layer']} | {c['n']} x {c['k']} | {c['rows']} | {c['bf16_us']:.1f} | {c['nvfp4_us']:.1f} | "
              f"{c['speedup']:.2f}x | {c['fraction_of_ceiling']:.0%} | {c['nvfp4_gb_per_s']:.0f} |" for c in cells]
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        print("skip: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured, no file written")
        return
    info = device()
    flush = torch.empty(flush_bytes(info["l2_bytes"]), dtype=torch.uint8, device="cuda")
    cells = []
    for name, (n, k) in LAYERS.items():
        for rows in args.rows:
            cells.append(measure(name, n, k, rows, flush, args.repeats))
            c = cells[-1]
            print(f"{name} M={rows}: bf16 {c['bf16_us']:.1f} us, NVFP4 {c['nvfp4_us']:.1f} us, "
                  f"{c['speedup']:.2f}x ({c['fraction_of_ceiling']:.0%} of the ceiling)", flush=True)
    report = {"device": info, "repeats": args.repeats, "ceiling": CEILING, "target_fraction": TARGET_FRACTION,
              "flush_bytes": flush.numel(), "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(cells))


if __name__ == "__main__":
    main()

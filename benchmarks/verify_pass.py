"""What a verify pass costs against a one-token decode step: SmolLM2-135M, batch 1, fused CPU kernel.

Speculation pays off by `τ / (verify cost / decode cost + drafter cost)`, so the price of feeding a
block of n tokens instead of one is half of every speedup. This measures one forward pass of the
fused C++ decoder (`kernels/cpu_decode.cpp`, the LM head left out) for n rows (`--rows`, by default
1, 2, 3, 4 and 8) of one sequence at several context lengths, on the real model's weights and a filled KV cache: bf16
(the GGUF dequantized) or, with `--weights gguf`, the file's own Q4_1 blocks, or NVFP4 (`nvfp4`).

With `--baseline-rev REV` the kernel source at git revision REV is built too, for the same
instruction set (its `Decoder` renamed, so both load in one process), and measured interleaved with
this checkout's, pass by pass, so both see the same machine: the side-by-side figure for a kernel
change. With `--weights gguf` the baseline reads the file's blocks as its own `pack_ggml` lays them
out (a second copy of the model), since a kernel change may lay the tiles out differently. Revisions
before the per-instruction-set builds are AVX-512 BF16 code and build only there.

Writes `benchmarks/results/verify_pass.json` and prints a markdown table. Run:
`.venv/bin/python benchmarks/verify_pass.py --baseline-rev HEAD~1`. This is not a test: it asserts
nothing and takes a minute or two.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from specloop.engine.cpu.fused_decode import MAX_ROWS, FusedDecoder
from specloop.engine.loaders.load import (build_model, default_model_path, gguf_modules, load_for_inference,
                                          read_stored_model)
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.model.attention import cache_dtype
from specloop.engine.model.gguf_linear import apply_gguf
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.kernels.cpu_decode import SOURCE as KERNEL
from specloop.kernels.cpu_decode import compile_module, cpu_plan

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "verify_pass.json"
WEIGHTS = {"bf16": WeightFormat(), "gguf": WeightFormat("gguf"), "nvfp4": WeightFormat("nvfp4")}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 700, 1000], help="cached tokens before the pass")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="rows per pass (1 first: the ratios)")
    p.add_argument("--repeats", type=int, default=30, help="passes per cell (the median is reported)")
    p.add_argument("--baseline-rev", help="git revision whose kernel to measure side by side")
    p.add_argument("--weights", choices=sorted(WEIGHTS), default="bf16", help="how the target holds its weights")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if 1 not in args.rows or min(args.rows) < 1 or max(args.rows) > MAX_ROWS:
        p.error(f"--rows: counts from 1 to {MAX_ROWS} (the fused decoder's widest pass), 1 among them "
                "(every pass is set against the one-row pass)")
    return args


def baseline_kernel(rev: str, workdir: Path) -> types.SimpleNamespace:
    """The kernel at `rev` with its headers, built under another module and class name so it loads beside ours."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True, cwd=KERNEL.parent.parent).stdout

    for path in git("ls-tree", "--name-only", rev, "kernels/").split():
        if path.endswith(".h"):
            (workdir / Path(path).name).write_text(git("show", f"{rev}:{path}"))
    source = workdir / "baseline_cpu_decode.cpp"
    source.write_text(re.sub(r"\bDecoder\b", "BaselineDecoder", git("show", f"{rev}:kernels/{KERNEL.name}")))
    module = compile_module("baseline_cpu_decode", source, cpu_plan().isa, workdir)
    return types.SimpleNamespace(Decoder=module.BaselineDecoder, pack_ggml=getattr(module, "pack_ggml", None),
                                 isa=cpu_plan().isa)


def baseline_target(model: torch.nn.Module, gguf: Path, weights: str, kernel: types.SimpleNamespace) -> torch.nn.Module:
    """The target the baseline kernel runs: `model` itself, but for `gguf` weights a copy whose tiles
    the baseline packed (the `Decoder` packs dense and NVFP4 matrices itself)."""
    if weights != "gguf":
        return model
    path, stored = read_stored_model(gguf)
    copy = build_model(stored, model.dtype, model.device)
    apply_gguf(copy, gguf_modules(path, stored, model.device), kernel)
    return copy


def median_ms(decoders: dict[str, FusedDecoder], cache: KVCache, hidden: int, context: int, n: int,
              repeats: int) -> dict[str, float]:
    """Median milliseconds of one n-row pass at `context`, each decoder in turn, pass by pass."""
    x = torch.randn(1, n, hidden, dtype=torch.bfloat16)
    batch = AttnBatch.build([0], [context], n, torch.device("cpu"), cache.max_len)
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for i in range(repeats + 3):
        for name, decoder in decoders.items():
            start = time.perf_counter()
            decoder.forward(x, cache, batch, ())
            if i >= 3:  # the first passes warm caches and thread pools
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()[0]
    gguf = default_model_path()
    model = load_for_inference(gguf, torch.bfloat16, torch.device("cpu"), WEIGHTS[args.weights]).model
    if model.fused_decoder is None:
        raise SystemExit("the fused CPU kernel does not build on this machine: nothing to measure")
    cache = KVCache(model.config, 1, max(args.contexts) + max(args.rows), cache_dtype(model.dtype, model.device),
                    model.device)
    torch.manual_seed(0)
    cache.k.normal_()  # attention reads every cached row: give it real numbers, not zeros
    cache.v.normal_()
    decoders = {"this": model.fused_decoder}
    with tempfile.TemporaryDirectory() as workdir:
        if args.baseline_rev:
            baseline = baseline_kernel(args.baseline_rev, Path(workdir))
            target = baseline_target(model, gguf, args.weights, baseline)
            decoders = {"baseline": FusedDecoder(baseline, target), **decoders}
        cells = []
        for context in args.contexts:
            for n in args.rows:
                ms = median_ms(decoders, cache, model.config.hidden_size, context, n, args.repeats)
                cells.append({"context": context, "rows": n, "ms": ms})
                print(f"context {context} rows {n}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()), flush=True)
    for cell in cells:  # each pass against the one-row pass at the same context, same kernel
        one = next(c for c in cells if c["context"] == cell["context"] and c["rows"] == 1)
        cell["vs_one_row"] = {k: v / one["ms"][k] for k, v in cell["ms"].items()}
    report = {
        "model": gguf.name,
        "dtype": "bfloat16",
        "weights": args.weights,
        "machine": describe(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "baseline_rev": args.baseline_rev and subprocess.run(
            ["git", "rev-parse", "--short", args.baseline_rev], check=True, capture_output=True, text=True,
            cwd=KERNEL.parent.parent).stdout.strip(),
        "repeats": args.repeats,
        "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown_table(cells, list(decoders)))


def markdown_table(cells: list[dict], names: list[str]) -> str:
    head = "| context | rows | " + " | ".join(f"{n} ms | {n} vs 1 row" for n in names) + " |"
    lines = [head, "| " + " | ".join(["---:"] * (2 + 2 * len(names))) + " |"]
    for c in cells:
        vals = " | ".join(f"{c['ms'][n]:.2f} | {c['vs_one_row'][n]:.2f}x" for n in names)
        lines.append(f"| {c['context']} | {c['rows']} | {vals} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

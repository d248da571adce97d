"""Decode throughput of NVFP4 weights on SmolLM2-135M-Instruct: specloop NVFP4, specloop bf16 and
llama.cpp Q4_1, side by side in one run.

The NVFP4 models are quantized on load from the GGUF (`load_model(..., WeightFormat("nvfp4"))`): the
projections alone, and the projections with the LM head (the embedding lookup stays dense in both:
an NVFP4 one buys no speed, docs/nvfp4.md). bf16 is the same GGUF dequantized to bf16. llama.cpp
runs the GGUF's own Q4_1 weights (5 bits per weight), batch 1 only, when `llama_cpp` is installed. Everything decodes greedily with
end-of-sequence ignored; batch 1 is `(N - 1) / (t(N) - t(1))` (prefill and first token taken out)
and concurrency 8 the aggregate of 8 requests at once, each the median of `--repeats` round-robin
rounds (`benchmarks/engine_throughput.py`, whose measurement this reuses).

Targets (issue 19): NVFP4 at least 1.8x our bf16 at batch 1, and ahead of llama.cpp Q4_1. Writes
`benchmarks/results/nvfp4_decode.json` and prints a markdown table. Run:
`.venv/bin/python benchmarks/nvfp4_decode.py`. This is not a test: it asserts nothing and takes minutes.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from specloop.engine.loaders.load import default_model_path, load_for_inference
from specloop.engine.loaders.weight_format import WeightFormat

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.engine_throughput import (  # noqa: E402
    Row,
    chat_prompts,
    markdown_table,
    measure,
    plain_runners,
)
from benchmarks.machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "nvfp4_decode.json"
SYSTEMS = {  # name -> how the target holds its weights
    "specloop bf16": WeightFormat(),
    "specloop NVFP4": WeightFormat("nvfp4"),
    "specloop NVFP4 + LM head": WeightFormat("nvfp4", lm_head=True),
}


def ratios(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Each NVFP4 system's batch-1 speed over our bf16 and over llama.cpp."""
    by_name = {r.system: r.batch1_tok_s for r in rows}
    llama = by_name.get("llama.cpp")
    return {name: {"vs_bf16": round(tok_s / by_name["specloop bf16"], 2),
                   "vs_llama_cpp": None if llama is None else round(tok_s / llama, 2)}
            for name, tok_s in by_name.items() if "NVFP4" in name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all systems")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu, gguf = torch.device("cpu"), default_model_path()
    load_before = os.getloadavg()[0]
    loaded = {name: load_for_inference(gguf, torch.bfloat16, cpu, weights) for name, weights in SYSTEMS.items()}
    runners, batch1_only = plain_runners(loaded, gguf)
    prompts = chat_prompts(loaded["specloop bf16"].tokenizer)
    rows = measure(runners, prompts, args.new_tokens, args.repeats, batch1_only)
    report = {
        "model": gguf.name,
        "machine": describe(),
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
        "batch1_ratios": ratios(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(rows))
    print(json.dumps(report["batch1_ratios"], indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()

"""Decode speed of SmolLM2-135M-Instruct by how the target holds its weights, side by side in one run:
llama.cpp on the GGUF's own Q4_1/Q8_0 blocks, specloop bf16 (the GGUF dequantized), specloop `gguf`
(the same blocks through the C++ kernel, `--weights gguf`) and NVFP4 with the LM head; and the
shipped drafter (with n-gram lookup, as `make run` serves it) on bf16 and on `gguf`.

Plain decoding: greedy, end-of-sequence ignored, batch 1 as `(N - 1) / (t(N) - t(1))` (prefill and
first token taken out) and concurrency 8 (llama.cpp: batch 1 only), the median of `--repeats`
round-robin rounds (`benchmarks/engine_throughput.py`'s measurement). Each format's bandwidth limit
is the bytes one decode step reads (the layer matrices and the LM head; the embedding is one row per
token) over this machine's measured read bandwidth.

Speculation: the first `--prompts` of the shipped drafter's 72 held-out `evals` prompts
(`benchmarks/shipped_drafter_prompts.py`), natural-length answers of at most `--new-tokens`, decode
tok/s and τ (`benchmarks/speculative_decoding.py`'s measurement), each weight format against its own
plain decoding (a format's greedy answers are its own; they must equal its plain ones).

Writes `benchmarks/results/gguf_decode.json` and prints markdown tables. Run:
`.venv/bin/python benchmarks/gguf_decode.py`. Not a test: it asserts nothing and takes minutes.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from specloop.engine.cpu.linear import CpuLinear, CpuNvfp4Linear
from specloop.engine.loaders.load import LoadedModel, default_model_path, load_for_inference
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.model.gguf_linear import BLOCK_FORMATS, GgufLinear
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks import engine_throughput, speculative_decoding  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.shipped_drafter_prompts import round1  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gguf_decode.json"
DRAFTER = Path(__file__).resolve().parents[1] / "daemon" / "drafters" / "SmolLM2-135M-Instruct"
SYSTEMS = {  # name -> how the target holds its weights
    "specloop bf16": WeightFormat(),
    "specloop gguf": WeightFormat("gguf"),
    "specloop NVFP4 + LM head": WeightFormat("nvfp4", lm_head=True),
}


def bytes_per_token(model: torch.nn.Module) -> int:
    """What one decode step reads of the weights: every linear layer (the LM head included) whole."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, GgufLinear):
            _, block_bytes, weights = BLOCK_FORMATS[module.ggml_type]
            total += module.out_features * module.in_features // weights * block_bytes
        elif isinstance(module, CpuNvfp4Linear):  # 4-bit codes and an E4M3 scale per 16
            total += module.q.packed.numel() + module.q.block_scale.numel()
        elif isinstance(module, CpuLinear) and not name.endswith(".dense"):  # not an NVFP4 layer's large-pass copy
            total += module.weight.numel() * module.weight.element_size()
    return total


def speculation(loaded: LoadedModel, prompts: list[list[int]], args: argparse.Namespace) -> list[dict]:
    """The shipped drafter with n-gram lookup against plain decoding, on one weight format."""
    drafter = load_drafter(DRAFTER, loaded.fingerprint, "cpu", torch.bfloat16).drafter
    eos, max_len = loaded.tokenizer.eos_token_ids, max(len(p) for p in prompts) + args.new_tokens + 1
    model = loaded.model
    proposer = CombinedProposer(DFlashProposer(drafter, model, 4), NgramProposer(4))
    runners = {speculative_decoding.PLAIN: (None, speculative_decoding.engine_runner(model, eos, max_len, None)),
               "specloop + DFlash & n-gram B=4": (4, speculative_decoding.engine_runner(model, eos, max_len, proposer))}
    tallies = speculative_decoding.measure(runners, prompts, args.new_tokens, args.repeats, eos)
    return [asdict(r) for r in speculative_decoding.rows_from(tallies, {k: b for k, (b, _) in runners.items()})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all systems")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for the speculative rows")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu, gguf = torch.device("cpu"), default_model_path()
    load_before = os.getloadavg()[0]
    machine = describe()
    loaded = {name: load_for_inference(gguf, torch.bfloat16, cpu, weights) for name, weights in SYSTEMS.items()}
    tokenizer = loaded["specloop bf16"].tokenizer
    runners, batch1_only = engine_throughput.plain_runners(loaded, gguf)
    plain = engine_throughput.measure(runners, engine_throughput.chat_prompts(tokenizer), args.new_tokens,
                                      args.repeats, batch1_only)
    read = machine["memory_read_gb_s"]
    limits = {name: {"bytes_per_token": (b := bytes_per_token(m.model)), "limit_tok_s": round(read * 1e9 / b, 1)}
              for name, m in loaded.items()}
    rows, held_ids = round1(tokenizer)
    held = [list(ids) for ids, _ in rows if ids in held_ids][: args.prompts]
    spec = {name: speculation(loaded[name], held, args) for name in ("specloop bf16", "specloop gguf")}
    report = {
        "model": gguf.name,
        "machine": machine,
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "plain": [asdict(r) for r in plain],
        "bandwidth_limits": limits,
        "speculation": spec,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(engine_throughput.markdown_table(plain))
    print(json.dumps({"bandwidth_limits": limits, "speculation": spec}, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()

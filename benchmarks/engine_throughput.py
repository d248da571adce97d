"""Decode throughput on SmolLM2-135M-Instruct: our engine against transformers' `generate`, side by side.

For each dtype (float32, bfloat16) both systems get the same chat prompts and generate the same
number of tokens greedily, end-of-sequence ignored so every run has the same length. Both run the
weights our GGUF reader dequantized (transformers as its own `LlamaForCausalLM`), so they do the
same arithmetic on the same numbers.

- batch 1: decode tokens/s of one request, `(N - 1) / (t(N) - t(1))`, i.e. with the prefill and the
  first token taken out; the median over a few prompts.
- concurrency 8: aggregate tokens/s of 8 requests at once, `8 N / t`, prefill included (the engine
  batches them continuously; transformers gets one left-padded batch).

Our engine is measured directly (`LLMEngine.generate`) and, unless `--no-http`, through the real
server (uvicorn, `/v1/completions`, one HTTP client thread per request).

llama.cpp (`llama_cpp`, on the GGUF's own Q4_1 weights) is added as a reference column, batch 1
only, when it is installed; it is not a dependency. Writes `benchmarks/results/engine_throughput.json`
and prints a markdown table. Run: `.venv/bin/python benchmarks/engine_throughput.py`.

This is not a test: it asserts nothing and takes minutes.
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.api import build_app
from engine.fingerprint import base_model_fingerprint
from engine.loading import LoadedModel, build_model, default_model_path, read_checkpoint
from engine.model import Transformer
from engine.sequence import SamplingParams
from engine.server_thread import serve_in_thread
from engine.settings import ServerSettings
from engine.tokenizer import Tokenizer
from engine.transformers_reference import transformers_llama

RESULTS = Path(__file__).parent / "results" / "engine_throughput.json"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
]
CONCURRENCY = 8


@dataclass(frozen=True)
class Row:
    system: str
    dtype: str
    batch1_tok_s: float
    concurrent_tok_s: float | None


def chat_prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def batch1_rate(generate: Callable[[list[int], int], None], prompts: list[list[int]], new_tokens: int) -> float:
    """Median decode tokens/s of single requests; `generate(prompt, n)` runs one to n tokens."""
    rates = []
    for prompt in prompts:
        t1 = _timed(lambda: generate(prompt, 1))
        tn = _timed(lambda: generate(prompt, new_tokens))
        rates.append((new_tokens - 1) / (tn - t1))
    return statistics.median(rates)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------ our engine


def bench_engine(model: Transformer, eos: tuple[int, ...], prompts: list[list[int]], new_tokens: int,
                 repeats: int) -> tuple[float, float]:
    engine = LLMEngine(model, EngineConfig(num_slots=CONCURRENCY, max_len=1024), eos)

    def run(batch: list[list[int]], n: int) -> None:
        seqs = engine.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(s.output_ids) == n for s in seqs)

    run(prompts[:1], 8)  # warm-up: first-call allocations
    b1 = batch1_rate(lambda p, n: run([p], n), prompts[:repeats], new_tokens)
    conc = CONCURRENCY * new_tokens / min(_timed(lambda: run(prompts, new_tokens)) for _ in range(repeats))
    return b1, conc


# ------------------------------------------------------------------------------ our engine, through HTTP


def bench_http(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, float]:
    """The same measurement through the real server: uvicorn, the OpenAI API, JSON, detokenization."""
    settings = ServerSettings(num_slots=CONCURRENCY, max_len=1024)
    engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids)
    engine.start()
    try:
        with serve_in_thread(build_app(loaded, engine, settings)) as url, httpx.Client(timeout=600) as client:
            def run(prompt: list[int], n: int) -> None:
                body = {"model": loaded.name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
                r = client.post(f"{url}/v1/completions", json=body)
                assert r.json()["usage"]["completion_tokens"] == n

            def run_all() -> None:
                with ThreadPoolExecutor(CONCURRENCY) as pool:
                    list(pool.map(lambda p: run(p, new_tokens), prompts))

            run(prompts[0], 8)
            b1 = batch1_rate(run, prompts[:repeats], new_tokens)
            conc = CONCURRENCY * new_tokens / min(_timed(run_all) for _ in range(repeats))
    finally:
        engine.stop()
    return b1, conc


# ---------------------------------------------------------------------------------------- transformers


def bench_transformers(model: torch.nn.Module, prompts: list[list[int]], pad_id: int, new_tokens: int,
                       repeats: int) -> tuple[float, float]:
    device = next(model.parameters()).device

    @torch.inference_mode()
    def run(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad_id)
        assert out.shape[1] == width + n

    run(prompts[:1], 8)
    b1 = batch1_rate(lambda p, n: run([p], n), prompts[:repeats], new_tokens)
    conc = CONCURRENCY * new_tokens / min(_timed(lambda: run(prompts, new_tokens)) for _ in range(repeats))
    return b1, conc


# ------------------------------------------------------------------------------------ llama.cpp (optional)


def bench_llama_cpp(gguf: Path, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)

    def run(prompt: list[int], n: int) -> None:
        tokens = llm.generate(prompt, top_k=1, temp=0.0, reset=True)  # endless: EOS is not checked here
        for _, _ in zip(range(n), tokens):
            pass

    run(prompts[0], 8)
    return batch1_rate(run, prompts[:repeats], new_tokens)


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="prompts timed at batch 1; runs at concurrency 8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure our engine through the HTTP server")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device, gguf = torch.device(args.device), default_model_path()
    _, ckpt = read_checkpoint(gguf)
    prompts = chat_prompts(ckpt.tokenizer)
    pad = ckpt.tokenizer.eos_token_ids[0]

    rows: list[Row] = []
    fingerprint = base_model_fingerprint(ckpt.weights_digest, ckpt.tokenizer)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ours = build_model(ckpt, dtype, device)
        rows.append(Row("specloop", name, *bench_engine(ours, ckpt.tokenizer.eos_token_ids, prompts,
                                                        args.new_tokens, args.repeats)))
        if args.http:
            loaded = LoadedModel(ours, ckpt.tokenizer, fingerprint, ckpt.name, gguf)
            rows.append(Row("specloop HTTP", name, *bench_http(loaded, prompts, args.new_tokens, args.repeats)))
        del ours
        hf = transformers_llama(ckpt, dtype, device)
        rows.append(Row("transformers", name, *bench_transformers(hf, prompts, pad, args.new_tokens, args.repeats)))
        del hf
        _print_progress(rows[-3 if args.http else -2:])
    if importlib.util.find_spec("llama_cpp") is not None:
        rows.append(Row("llama.cpp", "Q4_1", bench_llama_cpp(gguf, prompts, args.new_tokens, args.repeats), None))

    report = {
        "model": gguf.name,
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "concurrency": CONCURRENCY,
        "rows": [asdict(r) for r in rows],
        "speedup_batch1": {r.dtype: _speedup(rows, r.dtype, "batch1_tok_s") for r in rows if r.system == "specloop"},
        "speedup_concurrent": {r.dtype: _speedup(rows, r.dtype, "concurrent_tok_s")
                               for r in rows if r.system == "specloop"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(rows))
    print(f"\nwritten to {args.out}")


def _speedup(rows: list[Row], dtype: str, column: str) -> float:
    ours = next(getattr(r, column) for r in rows if r.system == "specloop" and r.dtype == dtype)
    theirs = next(getattr(r, column) for r in rows if r.system == "transformers" and r.dtype == dtype)
    return round(ours / theirs, 2)


def _print_progress(rows: list[Row]) -> None:
    for r in rows:
        print(f"  {r.system:12s} {r.dtype:8s} batch 1 {r.batch1_tok_s:7.1f} tok/s, "
              f"concurrency {CONCURRENCY} {r.concurrent_tok_s:7.1f} tok/s", flush=True)


def markdown_table(rows: list[Row]) -> str:
    lines = [f"| system | weights | batch 1 decode (tok/s) | concurrency {CONCURRENCY} aggregate (tok/s) |",
             "| --- | --- | ---: | ---: |"]
    for r in rows:
        conc = "–" if r.concurrent_tok_s is None else f"{r.concurrent_tok_s:.1f}"
        lines.append(f"| {r.system} | {r.dtype} | {r.batch1_tok_s:.1f} | {conc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

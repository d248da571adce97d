"""Decode throughput on SmolLM2-135M-Instruct: our engine against transformers' `generate`, side by side.

For each dtype (float32, bfloat16) both systems get the same chat prompts and generate the same
number of tokens greedily, end-of-sequence ignored so every run has the same length. Both run the
weights our GGUF reader dequantized (transformers as its own `LlamaForCausalLM`), so they do the
same arithmetic on the same numbers.

- batch 1: decode tokens/s of one request, `(N - 1) / (t(N) - t(1))`, i.e. with the prefill and the
  first token taken out.
- concurrency 8: aggregate tokens/s of 8 requests at once, `8 N / t`, prefill included (the engine
  batches them continuously; transformers gets one left-padded batch).

Every column is the median over `--repeats` rounds, and each round measures every system in turn,
so load from other processes on a shared machine falls on all of them alike.

Our engine is measured directly (`LLMEngine.generate`) and, unless `--no-http`, through the real server
as users run it: a `specloop serve` process (uvicorn, `/v1/completions`, one HTTP client thread per
request). It has its own process because a server thread in this one would give libgomp a second
thread team and slow every system measured here (engine/runtime/torch_thread.py).

llama.cpp (`llama_cpp`, on the GGUF's own Q4_1 weights) is added as a reference column, batch 1
only, when it is installed (llama-cpp-python built from source in its own venv or this one, not a
dependency). The JSON names the CPU, the instruction set our kernels ran on and llama.cpp's build
(`benchmarks/machine.py`). Writes `benchmarks/results/engine_throughput.json` and prints a markdown
table. Run: `.venv/bin/python benchmarks/engine_throughput.py`; to stand in for an AVX2-only CPU on
an AVX-512 one, prefix `SPECLOOP_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`.

This is not a test: it asserts nothing and takes minutes.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import (
    LoadedModel,
    build_model,
    default_model_path,
    read_stored_model,
    resolve_device,
)
from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.server_process import server_process  # noqa: E402
from benchmarks.transformers_reference import transformers_llama  # noqa: E402

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


Runner = Callable[[list[list[int]], int], None]  # generate n tokens for every prompt, all at once


@dataclass(frozen=True)
class Row:
    system: str
    dtype: str
    batch1_tok_s: float
    concurrent_tok_s: float | None


def chat_prompts(tok: Tokenizer) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(runners: dict[tuple[str, str], Runner], prompts: list[list[int]], new_tokens: int, repeats: int,
            batch1_only: set[tuple[str, str]]) -> list[Row]:
    """Round-robin over the systems `repeats` times; medians per system."""
    b1: dict[tuple[str, str], list[float]] = {k: [] for k in runners}
    conc: dict[tuple[str, str], list[float]] = {k: [] for k in runners}
    for run in runners.values():
        run(prompts[:1], 8)  # warm-up: first-call allocations, oneDNN kernel selection
    for i in range(repeats):
        prompt = [prompts[i % len(prompts)]]
        for key, run in runners.items():
            t1, tn = _timed(lambda: run(prompt, 1)), _timed(lambda: run(prompt, new_tokens))
            b1[key].append((new_tokens - 1) / (tn - t1))
            if key not in batch1_only:
                conc[key].append(CONCURRENCY * new_tokens / _timed(lambda: run(prompts, new_tokens)))
        print(f"  round {i + 1}/{repeats} done", flush=True)
    return [Row(system, dtype, statistics.median(b1[(system, dtype)]),
                statistics.median(conc[(system, dtype)]) if conc[(system, dtype)] else None)
            for system, dtype in runners]


# ------------------------------------------------------------------------------------------ our engine


def engine_runner(model: Transformer, eos: tuple[int, ...]) -> Runner:
    engine = LLMEngine(model, EngineConfig(num_slots=CONCURRENCY, max_len=1024), eos)

    def run(batch: list[list[int]], n: int) -> None:
        seqs = engine.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(s.output_ids) == n for s in seqs)

    return run


@contextmanager
def http_runner(dtype: str, log: Path) -> Iterator[Runner]:
    """Our engine as users run it: a `specloop serve` process (uvicorn, the OpenAI API, JSON, detokenization)."""
    args = ["--dtype", dtype, "--weights", "dense", "--num-slots", str(CONCURRENCY), "--max-len", "1024"]
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads()), "SPECLOOP_LOG_LEVEL": "warning"}
    with server_process(args, log, env) as server, httpx.Client(timeout=600) as client:
        model = client.get(f"{server.url}/v1/models").json()["data"][0]["id"]

        def one(prompt: list[int], n: int) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            assert client.post(f"{server.url}/v1/completions", json=body).json()["usage"]["completion_tokens"] == n

        def run(batch: list[list[int]], n: int) -> None:
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(lambda p: one(p, n), batch))

        yield run


def transformers_runner(model: torch.nn.Module, pad_id: int) -> Runner:
    device = next(model.parameters()).device

    @torch.inference_mode()
    def run(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad_id)
        assert out.shape[1] == width + n

    return run


# ------------------------------------------------------------------------------------ llama.cpp (optional)


def plain_runners(models: dict[str, LoadedModel], gguf: Path) -> tuple[dict[tuple[str, str], Runner],
                                                                     set[tuple[str, str]]]:
    """Our engine on each loaded bf16 model by system name, and llama.cpp on `gguf` where `llama_cpp`
    is installed; with the systems that run at batch 1 only (llama.cpp)."""
    runners = {(name, "bfloat16"): engine_runner(m.model, m.tokenizer.eos_token_ids) for name, m in models.items()}
    if importlib.util.find_spec("llama_cpp") is None:
        return runners, set()
    runners[("llama.cpp", "Q4_1")] = llama_cpp_runner(gguf)
    return runners, {("llama.cpp", "Q4_1")}


def llama_cpp_runner(gguf: Path) -> Runner:
    """Batch 1 only: llama-cpp-python's high-level API runs one sequence at a time."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)

    def run(batch: list[list[int]], n: int) -> None:
        (prompt,) = batch
        tokens = llm.generate(prompt, top_k=1, temp=0.0, reset=True)  # endless: EOS is not checked here
        for _, _ in zip(range(n), tokens):
            pass

    return run


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all systems")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure our engine through the HTTP server")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads for every system; on a shared machine 1 avoids OpenMP barrier stalls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, gguf = resolve_device(args.device), default_model_path()
    load_before = os.getloadavg()[0]
    _, stored = read_stored_model(gguf)
    prompts = chat_prompts(stored.tokenizer)

    runners: dict[tuple[str, str], Runner] = {}
    batch1_only = set()
    with ExitStack() as stack:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            ours = optimize_for_cpu_inference(build_model(stored, dtype, device))
            runners[("specloop", name)] = engine_runner(ours, stored.tokenizer.eos_token_ids)
            if args.http:
                log = stack.enter_context(tempfile.TemporaryDirectory())
                runners[("specloop HTTP", name)] = stack.enter_context(http_runner(name, Path(log) / "serve.log"))
            hf = transformers_llama(stored, dtype, device)
            runners[("transformers", name)] = transformers_runner(hf, stored.tokenizer.eos_token_ids[0])
        if importlib.util.find_spec("llama_cpp") is not None:
            runners[("llama.cpp", "Q4_1")] = llama_cpp_runner(gguf)
            batch1_only.add(("llama.cpp", "Q4_1"))
        rows = measure(runners, prompts, args.new_tokens, args.repeats, batch1_only)

    report = {
        "model": gguf.name,
        "device": str(device),
        "machine": describe(),
        # Other processes competing for the cores slow every column; round-robin spreads it evenly.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "new_tokens": args.new_tokens,
        "concurrency": CONCURRENCY,
        "repeats": args.repeats,
        "rows": [asdict(r) for r in rows],
        "speedup_vs_transformers": {
            dtype: {"batch1": _speedup(rows, dtype, "batch1_tok_s"),
                    "concurrent": _speedup(rows, dtype, "concurrent_tok_s")}
            for dtype in ("float32", "bfloat16")
        },
        "batch1_vs_llama_cpp": {dtype: _vs_llama_cpp(rows, dtype) for dtype in ("float32", "bfloat16")},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(rows))
    print(f"\nwritten to {args.out}")


def _speedup(rows: list[Row], dtype: str, column: str) -> float:
    ours = next(getattr(r, column) for r in rows if r.system == "specloop" and r.dtype == dtype)
    theirs = next(getattr(r, column) for r in rows if r.system == "transformers" and r.dtype == dtype)
    return round(ours / theirs, 2)


def _vs_llama_cpp(rows: list[Row], dtype: str) -> float | None:
    ours = next(r.batch1_tok_s for r in rows if r.system == "specloop" and r.dtype == dtype)
    theirs = next((r.batch1_tok_s for r in rows if r.system == "llama.cpp"), None)
    return None if theirs is None else round(ours / theirs, 2)


def markdown_table(rows: list[Row]) -> str:
    lines = [f"| system | weights | batch 1 decode (tok/s) | concurrency {CONCURRENCY} aggregate (tok/s) |",
             "| --- | --- | ---: | ---: |"]
    for r in rows:
        conc = "–" if r.concurrent_tok_s is None else f"{r.concurrent_tok_s:.1f}"
        lines.append(f"| {r.system} | {r.dtype} | {r.batch1_tok_s:.1f} | {conc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Speculative decoding at batch 1 on SmolLM2-135M-Instruct: every drafter side by side, one run.

Systems, all greedy on the same held-out prompts (the `prompt_token_ids` of `--heldout`, prompts the
drafter never trained on), `--new-tokens` at most each, end-of-sequence honoured:

- our engine without speculation (the baseline every speedup is against);
- our engine with n-gram prompt lookup, with the DFlash drafter (`--drafter`; several compare
  drafters, their rows named by directory), and with both (`CombinedProposer`: n-gram when it
  matched, DFlash otherwise), at several block sizes each;
- transformers' `generate`, plain and with `prompt_lookup_num_tokens` (its n-gram lookup);
- llama.cpp's plain decoding (`llama_cpp`, the GGUF's own Q4_1 weights) as a reference column when
  it is installed; it is not a dependency.

The JSON names the CPU and the instruction set our kernels ran on (`benchmarks/machine.py`).

tokens/s = generated tokens / seconds over all prompts, one prompt at a time, prefill included.
Decode tokens/s leaves out the prefill and first token (timed by a separate 1-token run of each
prompt): the part speculation can speed up. At 96 new tokens the prefill of the evals prompts
(241 tokens on average) is about a fifth of plain decoding's time here.
Each column is the median over `--repeats` rounds, and each round measures every system in turn,
so load from other processes on a shared machine falls on all of them alike. τ (mean accepted
length, bonus token included) is pooled over all prompts: 1 + accepted tokens / verify steps.

Greedy speculation must be lossless: every system's tokens are compared with our plain engine's,
and a mismatch is reported (a `lossless` column and a warning), never hidden. transformers runs its
own kernels, so float rounding may legitimately flip a near-tie there; a mismatch in one of our own
speculative systems is a bug.

Writes `benchmarks/results/speculative_decoding.json` and prints a markdown table. Run:
`.venv/bin/python benchmarks/speculative_decoding.py`. This is not a test: it asserts nothing and
takes minutes.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import build_model, read_stored_model, resolve_device
from specloop.engine.loaders.stored_model import StoredModel
from specloop.engine.model.fingerprint import base_model_fingerprint
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer
from specloop.storage.sequences import read_sequences

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.transformers_reference import transformers_llama  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "speculative_decoding.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PLAIN = "specloop"


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    spec: SpecStats | None  # None for systems that report no acceptance counters


Runner = Callable[[list[int], int], Output]  # one prompt, at most n new tokens


@dataclass(frozen=True)
class Row:
    system: str
    block_size: int | None
    tok_s: float
    speedup: float
    decode_tok_s: float  # after the first token: what speculation can speed up (prefill it cannot)
    decode_speedup: float
    tau: float | None
    acceptance_rate: float | None
    lossless: str  # "k/N": prompts whose tokens equal our plain engine's


# ------------------------------------------------------------------------------------------ our engine


def engine_runner(model: Transformer, eos: tuple[int, ...], max_len: int, proposer: Proposer | None) -> Runner:
    engine = LLMEngine(model, EngineConfig(num_slots=1, max_len=max_len), eos, proposer)

    def run(prompt: list[int], n: int) -> Output:
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))
        return Output(seq.output_ids, seq.spec if proposer else None)

    return run


def engine_runners(model: Transformer, eos: tuple[int, ...], max_len: int, drafters: dict[str, DFlashDrafter],
                   ngram_blocks: list[int], dflash_blocks: list[int]) -> dict[str, tuple[int | None, Runner]]:
    """Our engine plain, with each n-gram and DFlash block size, and combined at each n-gram block
    size; with several drafters each DFlash row ends in its drafter's name."""
    runners: dict[str, tuple[int | None, Runner]] = {PLAIN: (None, engine_runner(model, eos, max_len, None))}
    for b in ngram_blocks:
        runners[f"specloop + n-gram B={b}"] = (b, engine_runner(model, eos, max_len, NgramProposer(b)))
    for name, drafter in drafters.items():
        tag = f" ({name})" if len(drafters) > 1 else ""
        for b in dflash_blocks:
            runners[f"specloop + DFlash B={b}{tag}"] = (b, engine_runner(model, eos, max_len,
                                                                         DFlashProposer(drafter, model, b)))
        for b in ngram_blocks:
            combined = CombinedProposer(DFlashProposer(drafter, model, b), NgramProposer(b))
            runners[f"specloop + DFlash & n-gram B={b}{tag}"] = (b, engine_runner(model, eos, max_len, combined))
    return runners


# ---------------------------------------------------------------------------------------- transformers


def transformers_runner(model: torch.nn.Module, eos: tuple[int, ...], lookup: int | None) -> Runner:
    device = next(model.parameters()).device
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}

    @torch.inference_mode()
    def run(prompt: list[int], n: int) -> Output:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=eos[0], **extra)
        return Output(out[0, len(prompt):].tolist(), None)

    return run


# ------------------------------------------------------------------------------------ llama.cpp (optional)


def llama_cpp_runner(gguf: Path, eos: tuple[int, ...]) -> Runner:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)

    def run(prompt: list[int], n: int) -> Output:
        out = []
        for token, _ in zip(llm.generate(prompt, top_k=1, temp=0.0, reset=True), range(n)):
            out.append(int(token))
            if token in eos:
                break
        return Output(out, None)

    return run


# --------------------------------------------------------------------------------------------- measure


def _until_eos(tokens: list[int], eos: tuple[int, ...], n: int) -> list[int]:
    """The first n tokens, cut after the first end-of-sequence (what every system should have produced)."""
    for i, t in enumerate(tokens[:n]):
        if t in eos:
            return tokens[:i + 1]
    return tokens[:n]


@dataclass
class Tally:
    """One system's measurements across rounds; outputs and counters come from the first round."""

    tok_s: list[float]
    decode_tok_s: list[float]
    outputs: list[list[int]]
    stats: list[SpecStats]


def measure(runners: dict[str, tuple[int | None, Runner]], prompts: list[list[int]], new_tokens: int, repeats: int,
            eos: tuple[int, ...]) -> dict[str, Tally]:
    """`repeats` rounds; in each, every prompt goes through every system in turn, so a burst of load
    from other processes lands on all systems rather than on whichever ran during it."""
    tallies = {name: Tally([], [], [], []) for name in runners}
    for _, run in runners.values():
        run(prompts[0], 16)  # warm-up: first-call allocations, kernel selection (the first call took 10 s here)
    for i in range(repeats):
        generated, seconds = dict.fromkeys(runners, 0), dict.fromkeys(runners, 0.0)
        first = dict.fromkeys(runners, 0.0)  # prefill + first token, timed by a separate 1-token run
        for prompt in prompts:
            for name, (_, run) in runners.items():
                start = time.perf_counter()
                run(prompt, 1)
                first[name] += time.perf_counter() - start
                start = time.perf_counter()
                out = run(prompt, new_tokens)
                seconds[name] += time.perf_counter() - start
                generated[name] += len(out.tokens)
                if i == 0:
                    tallies[name].outputs.append(_until_eos(out.tokens, eos, new_tokens))
                    if out.spec is not None:
                        tallies[name].stats.append(out.spec)
        for name in runners:
            tallies[name].tok_s.append(generated[name] / seconds[name])
            tallies[name].decode_tok_s.append((generated[name] - len(prompts)) / max(1e-9, seconds[name] - first[name]))
            print(f"  round {i + 1}/{repeats} {name}: {tallies[name].tok_s[-1]:.1f} tok/s", flush=True)
    return tallies


def rows_from(tallies: dict[str, Tally], blocks: dict[str, int | None]) -> list[Row]:
    plain = tallies[PLAIN]
    base, decode_base = statistics.median(plain.tok_s), statistics.median(plain.decode_tok_s)
    rows = []
    for name, t in tallies.items():
        tok_s, decode = statistics.median(t.tok_s), statistics.median(t.decode_tok_s)
        same = sum(a == b for a, b in zip(t.outputs, plain.outputs, strict=True))
        pooled = SpecStats.pooled(t.stats) if t.stats else None
        rate = pooled.accepted_tokens / pooled.draft_tokens if pooled and pooled.draft_tokens else None
        rows.append(Row(name, blocks[name], tok_s, tok_s / base, decode, decode / decode_base,
                        pooled.mean_accepted_length if pooled else None,
                        rate, f"{same}/{len(plain.outputs)}"))
    return rows


def best_of(rows: list[Row], prefix: str) -> Row | None:
    family = [r for r in rows if r.system.startswith(prefix)]
    return max(family, key=lambda r: r.tok_s) if family else None


# ------------------------------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Both come from the bootstrap recipe in the README: `specloop generate` writes heldout.jsonl,
    # `specloop train-drafter` on its train.jsonl writes the drafter.
    parser.add_argument("--heldout", type=Path, required=True,
                        help="JSONL or Parquet with prompt_token_ids (held out from drafter training)")
    parser.add_argument("--drafter", type=Path, nargs="+", default=[],
                        help="DFlash drafter artifact directories; DFlash systems are skipped for a missing one")
    parser.add_argument("--prompts", type=int, default=4, help="use the first N held-out prompts")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all systems")
    parser.add_argument("--ngram-blocks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--dflash-blocks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for field in ("prompts", "new_tokens", "repeats", "lookup_tokens"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    names = [p.name for p in args.drafter]
    if len(set(names)) < len(names):
        raise ValueError(f"--drafter directories must have distinct names (rows are named by them), got {names}")
    return args


def load_prompts(path: Path, n: int) -> list[list[int]]:
    prompts = [list(s.prompt) for s in read_sequences([path])][:n]
    if not prompts:
        raise ValueError(f"--heldout {path} holds no sequences")
    return prompts


def build_runners(args: argparse.Namespace, stored: StoredModel, gguf: Path, prompts: list[list[int]],
                  drafters: dict[str, DFlashDrafter]) -> dict[str, tuple[int | None, Runner]]:
    device, dtype, eos = torch.device(args.device), DTYPES[args.dtype], stored.tokenizer.eos_token_ids
    max_len = max(len(p) for p in prompts) + args.new_tokens + 1
    # transformers gets its own model: `optimize_for_cpu_inference` swaps our layers in place.
    ours = optimize_for_cpu_inference(build_model(stored, dtype, device))
    runners = engine_runners(ours, eos, max_len, drafters, args.ngram_blocks, args.dflash_blocks)
    hf = transformers_llama(stored, dtype, device)
    runners["transformers"] = (None, transformers_runner(hf, eos, None))
    runners[f"transformers prompt lookup ({args.lookup_tokens})"] = (args.lookup_tokens + 1,
                                                                     transformers_runner(hf, eos, args.lookup_tokens))
    if importlib.util.find_spec("llama_cpp") is not None:
        runners["llama.cpp (Q4_1)"] = (None, llama_cpp_runner(gguf, eos))
    return runners


def main() -> None:
    args = parse_args()
    args.device = str(resolve_device(args.device))
    load_before = os.getloadavg()[0]
    gguf, stored = read_stored_model(None)
    prompts = load_prompts(args.heldout, args.prompts)
    fingerprint = base_model_fingerprint(stored.weights_digest, stored.config, stored.tokenizer)
    drafters = {}
    for path in args.drafter:
        if path.is_dir():
            drafters[path.name] = load_drafter(path, fingerprint, args.device, DTYPES[args.dtype]).drafter
        else:
            print(f"no drafter at {path}: its DFlash systems skipped")
    if not args.drafter:
        print("no --drafter: DFlash systems skipped")
    runners = build_runners(args, stored, gguf, prompts, drafters)
    started = time.perf_counter()
    tallies = measure(runners, prompts, args.new_tokens, args.repeats, stored.tokenizer.eos_token_ids)
    rows = rows_from(tallies, {name: block for name, (block, _) in runners.items()})
    best = {family: best_of(rows, prefix) for family, prefix in
            (("n-gram", "specloop + n-gram"), ("dflash", "specloop + DFlash B="),
             ("combined", "specloop + DFlash & n-gram"))}
    best_ngram = best["n-gram"].block_size if best["n-gram"] else None
    report = {
        "model": gguf.name,
        "device": args.device,
        "dtype": args.dtype,
        "machine": describe(),
        # Other processes competing for the cores slow every column; round-robin spreads it evenly.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "heldout": str(args.heldout),
        "drafters": [str(p) for p in args.drafter if p.name in drafters],
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [asdict(r) for r in rows],
        "best": {family: asdict(r) if r else None for family, r in best.items()},
        # Each drafter combined with n-gram lookup, at the n-gram block size that was fastest on its own.
        "combined_at_best_ngram_block": [asdict(r) for r in rows if r.system.startswith(
            "specloop + DFlash & n-gram") and r.block_size == best_ngram],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown_table(rows, args.dtype))
    for r in rows:
        if r.system != PLAIN and not r.lossless.startswith(f"{len(prompts)}/"):
            print(f"WARNING: {r.system} differs from our plain greedy output on "
                  f"{len(prompts) - int(r.lossless.split('/')[0])} of {len(prompts)} prompts")
    print(f"\nwritten to {args.out}")


def markdown_table(rows: list[Row], dtype: str) -> str:
    lines = [f"| system ({dtype}) | block | tok/s | vs plain | decode tok/s | vs plain | τ | acceptance | "
             "same tokens as plain |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        block = "–" if r.block_size is None else str(r.block_size)
        tau = "–" if r.tau is None else f"{r.tau:.2f}"
        rate = "–" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        lines.append(f"| {r.system} | {block} | {r.tok_s:.1f} | {r.speedup:.2f}x | {r.decode_tok_s:.1f} | "
                     f"{r.decode_speedup:.2f}x | {tau} | {rate} | {r.lossless} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

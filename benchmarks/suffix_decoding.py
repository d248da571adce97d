"""Suffix decoding against n-gram lookup and the shipped DFlash drafter, live and replayed, side by side
in one run, on stored greedy answers of SmolLM2-135M-Instruct (`specloop generate` output).

Each set is read in arrival order and split: the first `--warm-fraction` are earlier traffic, which
a suffix cache holds before the rest arrive (as serving would have it), the rest are measured. Every
system starts from its own fresh cache warmed with the same earlier traffic, and a cache learns only
from the measured requests that have finished, never from a repeat of one, so no system sees an
answer before it is asked for it.

Systems: plain decoding; `ngram` (prompt lookup, block 4); `suffix` (block 16); the shipped drafter
with n-gram lookup (`combined`) and with suffix decoding (`dflash+suffix`).
Measured per system and set:
- replay τ over the measured answers, 8 at a time in order (`daemon/evaluation/replay.py`), and the
  decode speed the daemon's contest models for it from this machine's step costs
  (`daemon/evaluation/step_cost.py`), to check against the live figures;
- live: the measured prompts through the engine at concurrency 1 and 8, greedy, at most
  `--max-tokens` each, every engine at a concurrency pricing its verify passes by one measurement;
  tokens/s = generated tokens / wall seconds, prefill included; τ from the engine's counters (verify
  steps that carried a draft); whether the tokens equal plain decoding's.
Also the suffix cache's memory after streaming `--memory-responses` synthetic responses through it.

Writes `benchmarks/results/suffix_decoding.json` (with the CPU, `benchmarks/machine.py`) and prints a
table. Not a test: it asserts nothing and takes about 15 minutes on a 2-core Zen 3.
"""

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package

from benchmarks.machine import describe  # noqa: E402
from specloop.daemon.evaluation.replay import NAMESPACE, replay  # noqa: E402
from specloop.daemon.evaluation.step_cost import CostModel  # noqa: E402
from specloop.daemon.shipped_drafters import shipped_drafters  # noqa: E402
from specloop.engine.loaders.load import LoadedModel, load_for_inference, resolve_device  # noqa: E402
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from specloop.engine.runtime.sequence import SamplingParams  # noqa: E402
from specloop.engine.runtime.verify_cost import PassCost, measure_pass, pass_shapes  # noqa: E402
from specloop.engine.speculation.build import ProposerKind, build_proposer  # noqa: E402
from specloop.engine.speculation.drafter_artifact import load_drafter  # noqa: E402
from specloop.engine.speculation.proposer import Proposer  # noqa: E402
from specloop.engine.speculation.suffix_cache import SuffixCache  # noqa: E402
from specloop.storage.sequences import TokenSequence, read_sequences  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "suffix_decoding.json"
SYSTEMS: tuple[ProposerKind | None, ...] = (None, "ngram", "suffix", "combined", "dflash+suffix")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", required=True, metavar="NAME=FILE",
                   help="a name and a JSONL of stored answers (train.jsonl of `specloop generate`); repeatable")
    p.add_argument("--warm-fraction", type=float, default=2 / 3)
    p.add_argument("--live-prompts", type=int, default=24, help="measured prompts run live (the first of them)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--memory-responses", type=int, default=100_000, help="0: skip the memory measurement")
    p.add_argument("--systems", nargs="+", default=[s or "plain" for s in SYSTEMS],
                   choices=[s or "plain" for s in SYSTEMS], help="plain is always measured (the baseline)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


class Systems:
    """Builds each system's proposer over a fresh cache warmed with a set's earlier traffic."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        art = load_drafter(shipped_drafters()[loaded.fingerprint], loaded.fingerprint, loaded.model.device,
                           loaded.model.dtype)
        self.drafter = art.drafter

    def proposer(self, kind: ProposerKind, earlier: list[TokenSequence], namespace: str) -> Proposer:
        cache = SuffixCache()
        for s in earlier:
            cache.add(namespace, list(s.tokens))
        drafter = self.drafter if kind in ("combined", "dflash+suffix") else None
        return build_proposer(kind, self.loaded.model, drafter, suffix_cache=cache)


def live(loaded: LoadedModel, proposer: Proposer | None, prompts: list[list[int]], concurrency: int,
         max_tokens: int, verify_cost: PassCost | None = None) -> tuple[float, float | None, list[list[int]]]:
    """(tokens/s, τ or None, outputs) of generating every prompt in order at `concurrency`; with
    `verify_cost` (`shared_verify_cost`), the engine's width rule prices passes by it."""
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=concurrency, max_len=2048),
                       loaded.tokenizer.eos_token_ids, proposer, verify_cost=verify_cost)
    started = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    seconds = time.perf_counter() - started
    drafts = sum(s.spec.drafts for s in seqs)
    tau = 1 + sum(s.spec.accepted_tokens for s in seqs) / drafts if drafts else None
    return sum(len(s.output_ids) for s in seqs) / seconds, tau, [s.output_ids for s in seqs]


# A system answering a chunk of prompts greedily: per prompt, its output ids, drafts and accepted tokens.
Generate = Callable[[list[list[int]]], list[tuple[list[int], int, int]]]


@dataclass
class Totals:
    """What one system generated over its chunks of an `interleaved` run."""

    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def answers(seqs: list) -> list[tuple[list[int], int, int]]:
    """An engine's finished sequences as a `Generate` returns them."""
    return [(s.output_ids, s.spec.drafts, s.spec.accepted_tokens) for s in seqs]


def engine_system(loaded: LoadedModel, proposer: Proposer | None, concurrency: int, max_tokens: int,
                  verify_cost: PassCost | None = None) -> Generate:
    """One engine answering greedily; its proposer's state (suffix cache, calibration) lives across chunks."""
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=concurrency, max_len=2048),
                       loaded.tokenizer.eos_token_ids, proposer, verify_cost=verify_cost)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return lambda chunk: answers(engine.generate(chunk, greedy))


def interleaved(systems: dict[str, Generate], prompts: list[list[int]], chunk: int) -> dict[str, Totals]:
    """Every system answering the same prompts `chunk` at a time, each chunk on every system in turn,
    the order rotating by chunk, so that the VM's neighbours (which moved one system by 10-30% between
    runs made in turn on the Zen 3) weigh on every system alike: tokens/s = generated tokens over the
    wall seconds of the system's own chunks, prefill included."""
    names = list(systems)
    totals = {name: Totals() for name in names}
    for i in range(0, len(prompts), chunk):
        turn = i // chunk % len(names)
        for name in names[turn:] + names[:turn]:
            started = time.perf_counter()
            out = systems[name](prompts[i:i + chunk])
            t = totals[name]
            t.seconds += time.perf_counter() - started
            for ids, drafts, accepted in out:
                t.tokens, t.drafts, t.accepted = t.tokens + len(ids), t.drafts + drafts, t.accepted + accepted
                t.outputs.append(ids)
    return totals


def shared_verify_cost(loaded: LoadedModel, concurrency: int) -> PassCost:
    """The pass cost an engine at `concurrency` measures for itself, measured once for every system."""
    return measure_pass(loaded.model, pass_shapes(concurrency, EngineConfig(num_slots=concurrency).max_block_size))


def measure_set(systems: Systems, name: str, path: Path, args: argparse.Namespace) -> dict:
    seqs = read_sequences([path])
    cut = int(len(seqs) * args.warm_fraction)
    earlier, measured = seqs[:cut], seqs[cut:]
    prompts = [list(s.prompt) for s in measured[:args.live_prompts]]
    out = {"file": str(path), "earlier": len(earlier), "measured": len(measured), "live_prompts": len(prompts),
           "systems": {}}
    plain: dict[int, tuple[float, list[list[int]]]] = {}
    costs = CostModel(systems.loaded.model, [list(s.tokens) for s in measured[:8]], NAMESPACE)
    prices = {c: shared_verify_cost(systems.loaded, c) for c in args.concurrency}  # one per concurrency, for all
    for kind in (k for k in SYSTEMS if k is None or k in args.systems):
        label = kind or "plain"
        row: dict = {}
        if kind is not None:
            proposer = systems.proposer(kind, earlier, NAMESPACE)
            stats = replay(proposer, measured, systems.loaded.model, cost=costs.cost(proposer))
            row["replay_tau"] = round(stats.tau, 3)
            row["modelled_tokens_per_s"] = round(stats.tokens_per_s, 1)
        for c in args.concurrency:
            proposer = systems.proposer(kind, earlier, "") if kind else None  # generate()'s tenant is ""
            tok_s, tau, outputs = live(systems.loaded, proposer, prompts, c, args.max_tokens, prices[c])
            if kind is None:
                plain[c] = (tok_s, outputs)
            row[f"c{c}"] = {"tokens_per_s": round(tok_s, 1), "speedup": round(tok_s / plain[c][0], 3),
                            "tau": round(tau, 3) if tau else None, "lossless": outputs == plain[c][1]}
        out["systems"][label] = row
        print(name, label, json.dumps(row), flush=True)
    return out


def cache_memory(responses: int) -> dict:
    """Stream `responses` synthetic 300-token documents (prompt + response) of 8 tenants through a 4M-position
    cache: its own count of bytes at the end, and how much the process grew."""
    rng = np.random.default_rng(0)
    cache = SuffixCache(max_tokens=4_000_000)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for i in range(responses):
        cache.add(f"tenant-{i % 8}", rng.integers(0, 49152, 300).tolist())
    seconds = time.perf_counter() - started
    return {"responses": responses, "tokens_each": 300, "max_tokens": cache.max_tokens, "cached_positions": cache.size,
            "cache_mb": round(cache.nbytes / 2**20, 1),
            "peak_rss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024, 1),
            "add_ms_each": round(seconds / responses * 1e3, 3)}


def main() -> None:
    args = parse_args()
    memory = cache_memory(args.memory_responses) if args.memory_responses else None
    print("memory", json.dumps(memory), flush=True)
    loaded = load_for_inference(None, torch.bfloat16, resolve_device())
    systems = Systems(loaded)
    sets = {}
    for spec in args.set:
        name, _, file = spec.partition("=")
        sets[name] = measure_set(systems, name, Path(file), args)
    result = {"machine": describe(), "model": "SmolLM2-135M-Instruct (bf16)", "max_tokens": args.max_tokens,
              "warm_fraction": args.warm_fraction, "suffix_cache_memory": memory, "sets": sets}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

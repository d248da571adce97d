"""What a JSON schema costs at batch 1 on SmolLM2-135M-Instruct: decode tok/s and τ with and without
structured output, side by side in one run, speculating with the shipped drafter and n-gram lookup
(the `combined` proposer `specloop serve` drafts with).

Each round runs every prompt in both modes, in turn, so load from other processes falls on both
alike: free text (the model answers as it likes) and the same prompt under a schema (the grammar
masks every sampled position, and drafts outside it are rejected by verification,
engine/runtime/grammar.py). Greedy, end-of-sequence honoured, at most `--max-tokens` tokens.
Reported per mode: decode tok/s over the whole run (new tokens / wall time, prefill included), τ
(tokens per verify step) and the share of wall time spent computing masks. It also checks that the
constrained answers parse and validate. Writes `benchmarks/results/structured_output.json`.
Run: `.venv/bin/python benchmarks/structured_output.py`. Not a test: it asserts nothing else.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jsonschema
import torch

from specloop.daemon.shipped_drafters import shipped_drafters
from specloop.engine.loaders.load import load_for_inference
from specloop.engine.runtime.grammar import Grammar, GrammarCompiler
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.drafter_artifact import load_drafter

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "structured_output.json"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence", "topics"],
          "properties": {"answer": {"type": "string", "maxLength": 200}, "confidence": {"type": "number"},
                         "topics": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}}}
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "What does a compiler do?",
    "How do I reverse a list in Python?", "List three uses of copper.", "Explain photosynthesis briefly.",
    "What is a prime number?", "Who wrote Romeo and Juliet?",
]


class TimedGrammar:
    """A grammar whose masks add their time to `seconds` (the engine calls only these three)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar, self.seconds = grammar, 0.0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        allowed = self.grammar.masks(drafts)
        self.seconds += time.perf_counter() - start
        return allowed

    def accept(self, tokens: list[int]) -> None:
        self.grammar.accept(tokens)

    @property
    def finished(self) -> bool:
        return self.grammar.finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_for_inference(None, torch.bfloat16, torch.device("cpu"))
    artifact = load_drafter(shipped_drafters()[loaded.fingerprint], loaded.fingerprint, "cpu", torch.bfloat16)
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=1, max_len=1024), loaded.tokenizer.eos_token_ids,
                       build_proposer("combined", loaded.model, artifact.drafter))
    tok, compiler = loaded.tokenizer, GrammarCompiler(loaded.tokenizer)
    system = "Answer in JSON with the keys answer, confidence (0 to 1) and topics."
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}])) for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    totals = {mode: {"tokens": 0, "seconds": 0.0, "mask_seconds": 0.0, "spec": []} for mode in ("free", "schema")}
    valid = 0
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for prompt in prompts:
            for mode in ("free", "schema"):
                grammar = TimedGrammar(compiler.json_schema(SCHEMA)) if mode == "schema" else None
                start = time.perf_counter()
                (seq,) = engine.generate([prompt], params, [grammar])
                totals[mode]["seconds"] += time.perf_counter() - start
                totals[mode]["mask_seconds"] += grammar.seconds if grammar else 0.0
                totals[mode]["tokens"] += len(seq.output_ids)
                totals[mode]["spec"].append(seq.spec)
                if mode == "schema" and seq.finish_reason == "stop":
                    jsonschema.validate(json.loads(tok.decode(seq.output_ids)), SCHEMA)
                    valid += 1
    rows = {}
    for mode, t in totals.items():
        pooled = SpecStats.pooled(t["spec"])
        rows[mode] = {"tok_s": round(t["tokens"] / t["seconds"], 1), "tau": round(pooled.mean_accepted_length, 3),
                      "tokens": t["tokens"], "mask_share": round(t["mask_seconds"] / t["seconds"], 4)}
    report = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, bf16)", "proposer": "combined (shipped drafter + n-gram)",
              "machine": describe(), "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
              "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": len(prompts), "schema": SCHEMA,
              "rows": rows, "schema_answers_finished_and_valid": f"{valid}/{args.repeats * len(prompts)}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(rows, indent=2), report["schema_answers_finished_and_valid"])


if __name__ == "__main__":
    main()

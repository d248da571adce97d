"""Speculative serving at concurrency 8 with the C++ pass capped at 16 rows against 32: τ, speed, answers.

At 8 sequences and block 4 a verify pass holds 32 rows. `engine/cpu/fused_decode.py` runs passes
of up to `MAX_ROWS` rows in the kernel and larger ones eager, whose numerics differ (the kernel keeps
activations in fp32 between matrices). This generates greedy answers to the demo's held-out
formal-logic prompts (the ones `specloop replay` never sends) with a drafter + n-gram lookup, at
concurrency 8, once with each cap, alternating for `--rounds` rounds in one process, and reports
τ, decode tok/s, and how many answers equal plain decoding at concurrency 1 (which runs in the
kernel either way).

The drafter worth measuring is one retrained on the demo traffic (`data/daemon/runs/*/challenger`
after `make run` promoted it); the default, the shipped drafter, accepts too little to show much.
Writes `benchmarks/results/kernel_rows.json`. Run: `.venv/bin/python benchmarks/kernel_rows.py
--drafter DIR` (a few minutes). This is not a test.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import specloop.engine.cpu.fused_decode as fused_decode
from specloop.daemon.evaluation.live import generate_stats
from specloop.daemon.shipped_drafters import shipped_drafters
from specloop.daemon.traffic.sender import traffic_split
from specloop.daemon.training.prompts import prompt_set
from specloop.engine.loaders.load import load_for_inference, resolve_device
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.sequences import TokenSequence

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "kernel_rows.json"
CAPS = (16, 32)
MAX_TOKENS = 192  # as the demo traffic


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", type=Path, default=None, help="drafter artifact (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=40, help="held-out prompts to answer")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def plain_answers(loaded, prompts: list[list[int]]) -> list[TokenSequence]:
    """Greedy answers one sequence at a time: every pass in the kernel, whatever the cap."""
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=1, max_len=2048), loaded.tokenizer.eos_token_ids)
    out = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in out]


def main() -> None:
    args = parse_args()
    loaded = load_for_inference(None, torch.bfloat16, resolve_device(None))
    tok = loaded.tokenizer
    _, heldout = traffic_split(prompt_set("formal-logic"), 0.25)
    prompts = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in heldout[:args.prompts]]
    reference = plain_answers(loaded, prompts)
    path = args.drafter or shipped_drafters()[loaded.fingerprint]
    art = load_drafter(path, loaded.fingerprint, loaded.model.device, loaded.model.dtype)
    dflash = DFlashProposer(art.drafter, loaded.model)
    proposer = CombinedProposer(dflash, NgramProposer(dflash.block_size))
    rows = []
    for round_ in range(args.rounds):
        for cap in CAPS:
            fused_decode.MAX_ROWS = cap
            g = generate_stats(loaded.model, proposer, reference, args.concurrency)
            rows.append({"round": round_, "max_rows": cap, "tau": round(g["tau"], 3),
                         "tokens_per_second": g["tokens_per_second"], "seconds": g["seconds"],
                         "identical_to_concurrency_1": g["identical_to_stored"], "sequences": g["sequences"]})
            print(json.dumps(rows[-1]), flush=True)
    report = {"machine": describe(), "drafter": str(path), "block_size": dflash.block_size,
              "concurrency": args.concurrency, "prompts": len(prompts), "results": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

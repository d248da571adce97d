"""Suffix decoding with its estimates as drafted, corrected by what verify passes accepted, and
corrected with unpaid proposing skipped: side by side with plain decoding, interleaved, in one run.

The width rule (`engine/runtime/verify_cost.py`) verifies the draft columns that pay for the
positions they cost, by the proposer's estimates of acceptance. Suffix decoding's estimates are
the shares of a match's occurrences that agree, and a continuation every occurrence agreed on is
estimated certain; `engine/speculation/calibration.py` corrects them by what was accepted, and
`LLMEngine._skips_proposing` stops asking a proposer whose likely drafts never pay. Systems:

- plain decoding;
- `as drafted`: the estimates as suffix decoding makes them (a calibration whose prior outweighs any
  count), every step proposed;
- `corrected`: the estimates corrected, every step proposed;
- `corrected, unpaid skipped`: the engine as it stands;
- with `--systems`, also `dflash+suffix, every step` and `dflash+suffix, unpaid skipped`: the default
  proposer (the shipped drafter with suffix decoding), asked at every step or skipped where unpaid as
  the engine does (a skipped step still shows DFlash its pass).

Traffic: the demo's formal-logic prompts (`specloop replay`'s split): earlier traffic, which every
system's suffix cache holds before the held-out prompts arrive, is the target's greedy answers to
`--warm` of the sent prompts, or with `--traces` a run's consented traces (its dataset's Parquet
files: what serving's cache held, answers sampled as the demo's traffic asks); the first `--prompts` held-out prompts are measured, at most `--max-tokens`
each, greedy. Each concurrency's prompts are cut into chunks of twice the concurrency, and every
chunk runs on each system in turn (the order rotating by chunk), so that the VM's neighbours weigh
on every system alike. A system's engine, suffix cache and calibration live across its chunks (its
cache learns each finished request, as serving's does). tokens/s = generated tokens / wall seconds,
prefill included; every engine prices its passes by one measurement per concurrency.

Writes `benchmarks/results/suffix_width.json` (with the CPU) and prints a table. Not a test: it
asserts nothing; about 10 minutes on a 2-core Zen 3. Run: `.venv/bin/python benchmarks/suffix_width.py`.
"""

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.suffix_decoding import Generate, answers, interleaved, shared_verify_cost  # noqa: E402
from specloop.daemon.shipped_drafters import shipped_drafters  # noqa: E402
from specloop.daemon.traffic.sender import traffic_split  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402
from specloop.engine.loaders.load import load_for_inference, resolve_device  # noqa: E402
from specloop.engine.loaders.weight_format import WeightFormat  # noqa: E402
from specloop.engine.runtime import llm_engine  # noqa: E402
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from specloop.engine.runtime.sequence import SamplingParams  # noqa: E402
from specloop.engine.speculation.build import build_proposer  # noqa: E402
from specloop.engine.speculation.calibration import AcceptanceCalibration  # noqa: E402
from specloop.engine.speculation.drafter_artifact import load_drafter  # noqa: E402
from specloop.engine.speculation.proposer import Proposer  # noqa: E402
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer  # noqa: E402
from specloop.engine.speculation.suffix_cache import SuffixCache  # noqa: E402
from specloop.storage.sequences import read_sequences  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "suffix_width.json"
SYSTEMS = ("plain", "as drafted", "corrected", "corrected, unpaid skipped")
COMBINED = ("dflash+suffix, every step", "dflash+suffix, unpaid skipped")
SKIPPING = ("corrected, unpaid skipped", "dflash+suffix, unpaid skipped")
UNCORRECTED = 1e12  # a calibration prior no count outweighs: the estimates as drafted


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", choices=["dense", "gguf"], default="gguf")
    p.add_argument("--warm", type=int, default=100, help="sent prompts whose answers every cache holds first")
    p.add_argument("--traces", type=Path, nargs="+", default=None,
                   help="Parquet files of stored traces (a run's dataset) as the earlier traffic")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts measured")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS + COMBINED, default=list(SYSTEMS),
                   help="the systems measured (plain decoding always)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


@contextmanager
def proposing_every_step(skipping: bool):
    """The engine's skipping of unpaid proposing, on or (for the systems before it) off."""
    kept = llm_engine.UNPAID_STEPS
    llm_engine.UNPAID_STEPS = kept if skipping else sys.maxsize
    try:
        yield
    finally:
        llm_engine.UNPAID_STEPS = kept


def proposer(system: str, loaded, earlier: list[list[int]], block_size: int) -> Proposer | None:
    """`system`'s proposer over a suffix cache holding `earlier` (None: plain decoding)."""
    if system == "plain":
        return None
    cache = SuffixCache()
    for tokens in earlier:
        cache.add("", tokens)  # generate() serves tenant ""
    if system in COMBINED:
        shipped = shipped_drafters()[loaded.fingerprint]  # `--weights` dense and gguf: the file's own model
        drafter = load_drafter(shipped, loaded.fingerprint, loaded.model.device, loaded.model.dtype).drafter
        return build_proposer("dflash+suffix", loaded.model, drafter, suffix_cache=cache, max_block_size=block_size)
    proposer = SuffixProposer(SuffixConfig(block_size=block_size), cache)
    if system == "as drafted":
        proposer.calibration = AcceptanceCalibration(proposer.num_drafts, strength=UNCORRECTED)
    return proposer


def measure(loaded, prompts: list[list[int]], earlier: list[list[int]], concurrency: int,
            max_tokens: int, systems: tuple[str, ...]) -> dict:
    price = shared_verify_cost(loaded, concurrency)
    config = EngineConfig(num_slots=concurrency, max_len=2048)
    eos = loaded.tokenizer.eos_token_ids
    engines = {s: LLMEngine(loaded.model, config, eos, proposer(s, loaded, earlier, config.max_block_size),
                            verify_cost=price) for s in systems}
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def system(s: str) -> Generate:
        def generate(chunk: list[list[int]]) -> list[tuple[list[int], int, int]]:
            with proposing_every_step(s in SKIPPING):
                return answers(engines[s].generate(chunk, greedy))
        return generate

    totals = interleaved({s: system(s) for s in systems}, prompts, 2 * concurrency)
    plain = totals["plain"]
    row = {}
    for s, t in totals.items():
        row[s] = {"tokens_per_s": round(t.tokens_per_s, 1), "vs_plain": round(t.tokens_per_s / plain.tokens_per_s, 3),
                  "tau": round(t.tau, 3) if t.tau else None, "lossless": t.outputs == plain.outputs,
                  "step_outside_pass_ms": round(engines[s]._step_s * 1e3, 2)}  # the width rule's, at the end
        print(f"c{concurrency}", s, json.dumps(row[s]), flush=True)
    return row


def greedy_answers(loaded, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = LLMEngine(loaded.model, EngineConfig(num_slots=8, max_len=2048), loaded.tokenizer.eos_token_ids).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [list(a.prompt_ids) + list(a.output_ids) for a in out]


def main() -> None:
    args = parse_args()
    loaded = load_for_inference(None, torch.bfloat16, resolve_device(None), WeightFormat(args.weights))
    tok = loaded.tokenizer
    sent, heldout = traffic_split(prompt_set("formal-logic", None), 0.25)
    encode = lambda p: tok.encode(tok.apply_chat_template(list(p.messages)))  # noqa: E731
    if args.traces:
        earlier = [s.tokens for s in read_sequences(args.traces)]
    else:
        earlier = greedy_answers(loaded, [encode(p) for p in sent[:args.warm]], args.max_tokens)
    prompts = [encode(p) for p in heldout[:args.prompts]]
    systems = ("plain", *(s for s in SYSTEMS + COMBINED if s != "plain" and s in args.systems))
    report = {"machine": describe(), "weights": args.weights, "warm_traces": len(earlier),
              "traces": [str(p) for p in args.traces] if args.traces else "greedy answers", "prompts": len(prompts),
              "max_tokens": args.max_tokens,
              "live": {f"c{c}": measure(loaded, prompts, earlier, c, args.max_tokens, systems)
                       for c in args.concurrency}}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| concurrency | " + " | ".join(systems) + " |")
    for c, row in report["live"].items():
        print(f"| {c} | " + " | ".join(f"{row[s]['tokens_per_s']} ({row[s]['vs_plain']}x)" for s in systems) + " |")


if __name__ == "__main__":
    main()

"""What the target's pass costs per shape, against the two ways of pricing it, side by side in one run:
the `PassCost` the engine's width rule and the daemon's contest now use (interpolated between the
positions the engine measures, `engine/runtime/verify_cost.py`) and the one line fitted over those
same measurements that both used before.

On SmolLM2 (bf16, the CPU kernels), every (batch, width) for batch 1, 2, 4, 8 and width 1, 2, 4, 8,
16, on a cache of 256 positions: the best of `--rounds` medians each; then each model's price and its
error. Also plain decoding's step, live, at concurrency 1 and 8 (the first `--prompts` formal-logic
prompts, `--max-tokens` each): wall seconds per engine step, against the price of a pass of
1 and of 8 positions, since that is the step every speculative one is weighed against.

With `--set FILE` (stored greedy answers in arrival order, as `benchmarks/suffix_decoding.py` reads
them: the first two thirds warm the suffix cache, the rest are asked), the width rule live under
each price, side by side: suffix decoding alone and the shipped drafter + suffix decoding at
concurrency 1 and 8, the two prices back to back for each, tokens/s against plain decoding's and
whether the answers equal plain decoding's.

Writes `benchmarks/results/pass_cost.json`. Run: `.venv/bin/python benchmarks/pass_cost.py` (about
2 minutes on 2 cores). This is not a test.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.suffix_decoding import Systems, live  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402
from specloop.engine.loaders.load import load_for_inference, resolve_device  # noqa: E402
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from specloop.engine.runtime.model_runner import ModelRunner  # noqa: E402
from specloop.engine.runtime.sequence import SamplingParams, Sequence  # noqa: E402
from specloop.engine.runtime.verify_cost import Linear, PassCost, median_seconds, pass_shapes  # noqa: E402
from specloop.storage.sequences import read_sequences  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pass_cost.json"
BATCHES, WIDTHS = (1, 2, 4, 8), (1, 2, 4, 8, 16)
CONTEXT = 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--set", type=Path, help="stored answers (JSONL or Parquet) for the live width-rule A/B")
    p.add_argument("--live-prompts", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


@torch.inference_mode()
def measure(model, rounds: int) -> dict[tuple[int, int], float]:
    runner = ModelRunner(model, max(BATCHES), CONTEXT + max(WIDTHS), slack=0)
    best: dict[tuple[int, int], float] = {}
    for _ in range(rounds):
        for b in BATCHES:
            for w in WIDTHS:
                seqs = [Sequence([0], SamplingParams(), slot=i, num_cached=CONTEXT) for i in range(b)]
                block = torch.zeros(b, w, dtype=torch.long)
                s = median_seconds(lambda: runner.run_block(seqs, block, ()), repeats=7)
                best[(b, w)] = min(best.get((b, w), s), s)
    return best


def plain_step_seconds(loaded, prompts: list[list[int]], concurrency: int, max_tokens: int) -> float:
    """Wall seconds per engine step of plain decoding (its prefill steps among them, a few percent)."""
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=concurrency, max_len=2048, speculate=False),
                       loaded.tokenizer.eos_token_ids, None)
    started = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return (time.perf_counter() - started) / engine.stats().steps


def width_rule(loaded, answers: Path, prices: dict[str, PassCost], args: argparse.Namespace) -> dict:
    """Live tokens/s of suffix decoding alone and of the shipped drafter + suffix decoding with the
    engine's width rule priced each way; plain decoding's for the ratio."""
    seqs = read_sequences([answers])
    cut = len(seqs) * 2 // 3
    earlier, prompts = seqs[:cut], [list(s.prompt) for s in seqs[cut:cut + args.live_prompts]]
    systems, out = Systems(loaded), {"earlier": cut, "prompts": len(prompts)}
    for c in (1, 8):
        plain, _, plain_outputs = live(loaded, None, prompts, c, args.max_tokens)
        out[f"plain_c{c}"] = round(plain, 1)
        for kind in ("suffix", "dflash+suffix"):
            for name, price in prices.items():  # back to back, so that the machine's state is shared
                tok_s, _, outputs = live(loaded, systems.proposer(kind, earlier, ""), prompts, c, args.max_tokens,
                                         verify_cost=price)
                out[f"{kind}_c{c}_{name}"] = {"tokens_per_s": round(tok_s, 1), "speedup": round(tok_s / plain, 3),
                                              "lossless": outputs == plain_outputs}
                print(kind, f"c{c}", name, out[f"{kind}_c{c}_{name}"], flush=True)
    return out


def main() -> None:
    args = parse_args()
    loaded = load_for_inference(None, torch.bfloat16, resolve_device("cpu"))
    measured = measure(loaded.model, args.rounds)
    engine_shapes = pass_shapes(max(BATCHES), max(WIDTHS))
    interpolated = PassCost.fit({s: measured[s] for s in engine_shapes})
    line = Linear.fit([b * w for b, w in engine_shapes], [measured[s] for s in engine_shapes])
    rows = [{"batch": b, "width": w, "measured_ms": round(measured[(b, w)] * 1e3, 2),
             "pass_cost_ms": round(interpolated(b * w) * 1e3, 2), "one_line_ms": round(line(b * w) * 1e3, 2)}
            for b in BATCHES for w in WIDTHS]
    for r in rows:
        r["pass_cost_error"] = round(r["pass_cost_ms"] / r["measured_ms"] - 1, 3)
        r["one_line_error"] = round(r["one_line_ms"] / r["measured_ms"] - 1, 3)
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in prompt_set("formal-logic")[:args.prompts]]
    live = {f"c{c}": round(plain_step_seconds(loaded, prompts, c, args.max_tokens) * 1e3, 2) for c in (1, 8)}
    if args.set is not None:
        # As an engine of 8 slots prices it: its own shapes only, the one line fitted over the same.
        as_engine = PassCost.fit({s: measured[s] for s in pass_shapes(8, 16)})
        one_line = PassCost(tuple((n, line(n)) for n, _ in as_engine.points))
        live_ab = width_rule(loaded, args.set, {"pass_cost": as_engine, "one_line": one_line}, args)
    report = {"machine": describe(), "context": CONTEXT, "engine_shapes": engine_shapes, "shapes": rows,
              "mean_abs_error": {k: round(sum(abs(r[f"{k}_error"]) for r in rows) / len(rows), 3)
                                 for k in ("pass_cost", "one_line")},
              "plain_decode_step_ms": live,
              "priced_plain_step_ms": {"pass_cost": {"c1": round(interpolated(1) * 1e3, 2),
                                                     "c8": round(interpolated(8) * 1e3, 2)},
                                       "one_line": {"c1": round(line(1) * 1e3, 2), "c8": round(line(8) * 1e3, 2)}},
              **({"width_rule_live": live_ab} if args.set is not None else {})}
    print(f"{'B':>2} {'w':>3} {'measured':>9} {'PassCost':>9} {'one line':>9}")
    for r in rows:
        print(f"{r['batch']:>2} {r['width']:>3} {r['measured_ms']:>9} {r['pass_cost_ms']:>9} {r['one_line_ms']:>9}")
    print(json.dumps({k: report[k] for k in ("mean_abs_error", "plain_decode_step_ms", "priced_plain_step_ms")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What the LM head's exactness costs: `CpuLmHead` (rows whose top two logits lie within rounding of
each other computed again by the one-row kernel) against the plain `CpuLinear` head, live, side by
side in one process, bf16 SmolLM2.

Greedy answers of at most `--max-tokens` to the demo's held-out formal-logic prompts, at concurrency
1 and 8, with suffix decoding alone and with the shipped drafter + suffix decoding (each over a fresh
suffix cache), alternating the two heads for `--rounds` rounds: tok/s with the prefill included, τ,
and whether every answer equals plain decoding's with the exact head. Plain decoding never reaches
the check (its passes fit the kernel's rows up to 8 sequences); speculation's verify passes do.
On a CPU whose oneDNN has no native bf16 the kernel takes passes of up to 32 rows, and the two heads
are the same there.

Writes `benchmarks/results/lm_head_exactness.json` (with the CPU). Not a test: it asserts nothing and
takes about 5 minutes on 2 cores.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from specloop.daemon.shipped_drafters import shipped_drafters
from specloop.daemon.traffic.sender import traffic_split
from specloop.daemon.training.prompts import prompt_set
from specloop.engine.cpu.linear import CpuLinear, CpuLmHead
from specloop.engine.loaders.load import load_for_inference
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.suffix_cache import SuffixCache

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.suffix_decoding import live  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "lm_head_exactness.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    loaded = load_for_inference(None, torch.bfloat16, torch.device("cpu"))
    assert type(loaded.model.lm_head) is CpuLmHead
    tok = loaded.tokenizer
    _, heldout = traffic_split(prompt_set("formal-logic"), 0.25)
    prompts = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in heldout][:args.prompts]
    drafter = load_drafter(shipped_drafters()[loaded.fingerprint], loaded.fingerprint, loaded.model.device,
                           loaded.model.dtype).drafter
    exact = CpuLmHead.forward
    plain = {c: live(loaded, None, prompts, c, args.max_tokens)[2] for c in (1, 8)}
    rows = []
    for round_ in range(args.rounds):
        for head in ("exact", "plain"):
            CpuLmHead.forward = exact if head == "exact" else CpuLinear.forward
            for c in (1, 8):
                for kind in ("suffix", "dflash+suffix"):
                    proposer = build_proposer(kind, loaded.model, None if kind == "suffix" else drafter,
                                              suffix_cache=SuffixCache())
                    tok_s, tau, outputs = live(loaded, proposer, prompts, c, args.max_tokens)
                    rows.append({"round": round_, "head": head, "concurrency": c, "proposer": kind,
                                 "tokens_per_s": round(tok_s, 1), "tau": round(tau or 0, 3),
                                 "lossless": outputs == plain[c]})
                    print(json.dumps(rows[-1]), flush=True)
    CpuLmHead.forward = exact
    args.out.write_text(json.dumps({"machine": describe(), "prompts": len(prompts), "max_tokens": args.max_tokens,
                                    "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

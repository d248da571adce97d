"""The prompt files for the shipped drafter's later rounds, for `specloop generate --source file`.

Writes three JSONL files of `{"messages": [...]}` into `--out`:

- `heldout.jsonl`: the 72 held-out prompts of the first round's data (`--source evals --per-task 8
  --limit 1536`, seed 0, held out by prompt hash at 0.05): every shipped drafter is compared on the
  target's answers to these, and none was trained on them.
- `round1.jsonl`: all 1,536 prompts of the first round (held-out ones included: generate holds the
  same 72 out again, by prompt hash). Round 4 answered `round1.jsonl` followed by the first 1,536
  lines of `round2.jsonl`.
- `round2.jsonl`: `--per-task 16 --seed 11` over all tasks, without the first round's 1,536 prompts and
  without repeats, in a seeded random order. The first round's `--limit` took only the first tasks in
  file order; in random order, a generate run stopped after N answers holds a sample of every task.

A round's data is the first N prompts of `round2.jsonl` (N in its results file,
`benchmarks/results/shipped_drafter_round2.json`); `generate` appends answers in chunks, so a run
stopped between chunks is such a prefix.
This file is not the data (the target's answers are) and not the training (docs/drafter-training.md).
"""

import argparse
import json
import random
from pathlib import Path

import torch

from specloop.daemon.training.prompts import Prompt, prompt_set
from specloop.engine.loaders.load import load_model, resolve_device
from specloop.engine.model.tokenizer import Tokenizer
from specloop.storage.sequences import TokenSequence, split_heldout

MAX_TOKENS, MAX_LEN = 256, 1536  # generate's --max-tokens and context length, both rounds
ROUND1 = dict(per_task=8, seed=0, limit=1536, heldout=0.05)
ROUND2 = dict(per_task=16, seed=11)


def fitting(tok: Tokenizer, prompts: list[Prompt]) -> list[tuple[tuple[int, ...], Prompt]]:
    """(chat-templated ids, prompt) for the prompts whose answer fits the context, as generate keeps them."""
    encoded = [(tuple(tok.encode(tok.apply_chat_template(list(p.messages)))), p) for p in prompts]
    return [(ids, p) for ids, p in encoded if len(ids) + MAX_TOKENS <= MAX_LEN]


def round1(tok: Tokenizer) -> tuple[list[tuple[tuple[int, ...], Prompt]], set[tuple[int, ...]]]:
    """The first round's prompts, and the ids of those it held out."""
    rows = fitting(tok, prompt_set("evals", None, ROUND1["per_task"], ROUND1["seed"]))[:ROUND1["limit"]]
    _, held = split_heldout([TokenSequence(ids, ()) for ids, _ in rows], ROUND1["heldout"])
    return rows, {s.prompt for s in held}


def round2(tok: Tokenizer, skip: set[tuple[int, ...]]) -> list[Prompt]:
    """The second round's prompts, in their seeded random order."""
    out, seen = [], set(skip)
    for ids, p in fitting(tok, prompt_set("evals", None, ROUND2["per_task"], ROUND2["seed"])):
        if ids not in seen:
            seen.add(ids)
            out.append(p)
    random.Random(ROUND2["seed"]).shuffle(out)
    return out


def write(path: Path, prompts: list[Prompt]) -> None:
    path.write_text("".join(json.dumps({"messages": [dict(m) for m in p.messages]}) + "\n" for p in prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tok = load_model(None, torch.bfloat16, resolve_device()).tokenizer
    rows, held = round1(tok)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "heldout.jsonl", [p for ids, p in rows if ids in held])
    write(args.out / "round1.jsonl", [p for _, p in rows])
    write(args.out / "round2.jsonl", round2(tok, {ids for ids, _ in rows}))
    print(json.dumps({"round1": len(rows), "heldout": len(held)}))


if __name__ == "__main__":
    main()

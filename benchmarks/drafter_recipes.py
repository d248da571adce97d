"""DFlash training throughput on the real target, recipe against recipe, in one run.

What a CPU-minute of training buys depends on how the step is laid out, not just how fast it runs.
Each recipe trains the same steps on the same SmolLM2 answers with the feature cache filled
beforehand (the steady state of a multi-epoch run), trimmed output vocabulary, bf16 target, 1
drafter layer:

- `b16-32anchors-fp32`: the earlier recipe, block 16, 32 random response anchors per sequence,
  fp32 drafter;
- `b4-dense-fp32`: block 4 (what this CPU serves best), every response position an anchor;
- `b4-dense-bf16`: the same under bf16 autocast;
- `b4-dense-bf16-distill`: the same, anchors in prompts too with the target's greedy picks as labels.

Reports steps/s, supervised block positions/s and first-draft labels/s (the position every
accepted draft depends on), each the best of `--repeats` rounds; recipes alternate within a round
so background load falls on all alike. Writes benchmarks/results/drafter_recipes.json.

Usage: python benchmarks/drafter_recipes.py --data answers.jsonl [--steps 8] [--repeats 2]
"""

import argparse
import json
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.trainer import Trainer
from specloop.engine.loaders.load import load_for_inference
from specloop.storage.sequences import read_sequences

RECIPES = {
    "b16-32anchors-fp32": dict(block_size=16, num_anchors=32),
    "b4-dense-fp32": dict(block_size=4, num_anchors=4096),
    "b4-dense-bf16": dict(block_size=4, num_anchors=4096, mixed_precision=True),
    "b4-dense-bf16-distill": dict(block_size=4, num_anchors=4096, mixed_precision=True, distill=True),
}


def measure(name: str, cfg: TrainConfig, loaded, sequences: list) -> dict:  # noqa: ANN001 (LoadedModel)
    trainer = Trainer(cfg, loaded.model, loaded.fingerprint, sequences)
    warmup = -(-len(sequences) // cfg.batch_size)  # one epoch: fills the feature cache
    trainer.advance(warmup)
    seen, first = trainer.supervised_seen, trainer.first_drafts_seen
    t0 = time.perf_counter()
    trainer.advance(cfg.max_steps)
    seconds = time.perf_counter() - t0
    return {"recipe": name, "steps": cfg.max_steps - warmup, "seconds": round(seconds, 2),
            "steps_per_second": (cfg.max_steps - warmup) / seconds,
            "supervised_per_second": (trainer.supervised_seen - seen) / seconds,
            "first_drafts_per_second": (trainer.first_drafts_seen - first) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=16, help="Train on the first N sequences")
    args = ap.parse_args()
    loaded = load_for_inference(None, torch.bfloat16, torch.device("cpu"))
    sequences = read_sequences(args.data)[:args.sequences]
    warmup = -(-len(sequences) // args.batch_size)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, recipe in RECIPES.items():
                cfg = TrainConfig(out_dir=f"{tmp}/{r}-{name}", max_steps=warmup + args.steps,
                                  batch_size=args.batch_size, heldout_fraction=0.0, checkpoint_every=10**9,
                                  trim_vocab=True, progress=False, resume=False, **recipe)
                runs.append(measure(name, cfg, loaded, sequences))
                print(runs[-1], flush=True)
    best = {name: max((x for x in runs if x["recipe"] == name), key=lambda x: x["steps_per_second"])
            for name in RECIPES}
    base = best["b16-32anchors-fp32"]
    result = {
        "when": datetime.now(UTC).isoformat(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "model": loaded.name, "sequences": len(sequences),
        "response_tokens": sum(len(s.response) for s in sequences),
        "prompt_tokens": sum(len(s.prompt) for s in sequences), "batch_size": args.batch_size,
        "recipes": RECIPES, "runs": runs, "best": best,
        "first_drafts_per_second_vs_b16": {n: b["first_drafts_per_second"] / base["first_drafts_per_second"]
                                           for n, b in best.items()},
    }
    out = Path(__file__).parent / "results" / "drafter_recipes.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["first_drafts_per_second_vs_b16"], indent=2))


if __name__ == "__main__":
    main()

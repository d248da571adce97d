"""DFlash training speed on the real target: output-vocabulary trimming and the feature cache, side by side.

Each configuration trains the same number of steps on the same data (batch and anchors as given);
runs alternate so that background load hits all alike. With the feature cache on, warm-up steps
first fill it (one pass over `--sequences` sequences), so the timed steps show the steady state of
a multi-epoch run; with it off, every step runs the target.
Reports steps/s and response tokens/s (training sequences' response tokens passed per second),
and writes JSON to benchmarks/results/drafter_training.json.

Usage: python benchmarks/drafter_training.py --data answers.jsonl [--steps 10] [--repeats 2]
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
from specloop.engine.loaders.load import load_model
from specloop.storage.sequences import read_sequences


def measure(cfg: TrainConfig, loaded, sequences: list, warmup: int) -> dict:  # noqa: ANN001 (LoadedModel)
    trainer = Trainer(cfg, loaded.model, loaded.fingerprint, sequences)
    trainer.advance(warmup)  # first-call allocations (and filling the feature cache), excluded
    t0 = time.perf_counter()
    trainer.advance(cfg.max_steps)
    seconds = time.perf_counter() - t0
    steps = cfg.max_steps - warmup
    return {"trim_vocab": cfg.trim_vocab, "feature_cache": cfg.feature_cache_gb > 0,
            "output_vocab": trainer.drafter.vocab_ids.numel(), "steps": steps, "seconds": round(seconds, 2),
            "steps_per_second": steps / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--sequences", type=int, default=8, help="Train on the first N sequences")
    args = ap.parse_args()
    loaded = load_model(None, torch.float32, torch.device("cpu"))
    sequences = read_sequences(args.data)[:args.sequences]
    cases = [(trim, cache) for cache in (False, True) for trim in (False, True)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for trim, cache in cases:
                warmup = -(-len(sequences) // args.batch_size) if cache else 1
                cfg = TrainConfig(out_dir=f"{tmp}/{r}-{trim}-{cache}", num_layers=args.layers,
                                  max_steps=args.steps + warmup, batch_size=args.batch_size, num_anchors=args.anchors,
                                  heldout_fraction=0.0, checkpoint_every=10**9, trim_vocab=trim,
                                  feature_cache_gb=4.0 if cache else 0.0, progress=False, resume=False)
                runs.append(measure(cfg, loaded, sequences, warmup))
                print(runs[-1], flush=True)
    best = {c: max(x["steps_per_second"] for x in runs if (x["trim_vocab"], x["feature_cache"]) == c) for c in cases}
    result = {
        "when": datetime.now(UTC).isoformat(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "model": loaded.name, "sequences": len(sequences),
        "batch_size": args.batch_size, "anchors": args.anchors, "layers": args.layers, "runs": runs,
        "best_steps_per_second": {f"{'trimmed' if t else 'full'}_vocab{'+feature_cache' if c else ''}": v
                                  for (t, c), v in best.items()},
        "trim_speedup": best[(True, False)] / best[(False, False)],
        "trim_speedup_with_feature_cache": best[(True, True)] / best[(False, True)],
        "feature_cache_and_trim_speedup": best[(True, True)] / best[(False, False)],
    }
    out = Path(__file__).parent / "results" / "drafter_training.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "speed" in k}, indent=2))


if __name__ == "__main__":
    main()

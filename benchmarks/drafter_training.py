"""DFlash training speed on the real target, with and without output-vocabulary trimming, side by side.

Each configuration trains the same number of steps on the same data (target hidden states computed
on the fly, batch and anchors as given); runs alternate so that background load hits both alike.
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

from engine.dflash_train import Trainer, TrainConfig
from engine.loading import load_model
from engine.training_data import read_sequences


def measure(cfg: TrainConfig, loaded, sequences: list) -> dict:  # noqa: ANN001 (LoadedModel)
    trainer = Trainer(cfg, loaded.model, loaded.fingerprint, sequences)
    trainer.advance(1)  # warm-up: first-call allocations, excluded
    t0 = time.perf_counter()
    trainer.advance(cfg.max_steps)
    seconds = time.perf_counter() - t0
    steps = cfg.max_steps - 1
    return {"trim_vocab": cfg.trim_vocab, "output_vocab": trainer.drafter.vocab_ids.numel(), "steps": steps,
            "seconds": round(seconds, 2), "steps_per_second": steps / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    loaded = load_model(None, torch.float32, torch.device("cpu"))
    sequences = read_sequences(args.data)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for trim in (False, True):
                cfg = TrainConfig(out_dir=f"{tmp}/{r}-{trim}", num_layers=args.layers, max_steps=args.steps + 1,
                                  batch_size=args.batch_size, num_anchors=args.anchors, heldout_fraction=0.0,
                                  checkpoint_every=10**9, trim_vocab=trim, progress=False, resume=False)
                runs.append(measure(cfg, loaded, sequences))
                print(runs[-1], flush=True)
    best = {t: max(x["steps_per_second"] for x in runs if x["trim_vocab"] == t) for t in (False, True)}
    result = {
        "when": datetime.now(UTC).isoformat(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "model": loaded.name, "sequences": len(sequences),
        "batch_size": args.batch_size, "anchors": args.anchors, "layers": args.layers, "runs": runs,
        "best_steps_per_second": {"full_vocab": best[False], "trimmed_vocab": best[True]},
        "trim_speedup": best[True] / best[False],
    }
    out = Path(__file__).parent / "results" / "drafter_training.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["best_steps_per_second"]), f"speedup {result['trim_speedup']:.2f}x")


if __name__ == "__main__":
    main()

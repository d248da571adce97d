"""DFlash τ on the NVFP4 target before and after retraining the drafter on it.

The NVFP4 target is SmolLM2-135M-Instruct's default GGUF quantized on load, projections in NVFP4 and
the LM head dense (`specloop serve --weights nvfp4`): another base model, with its own fingerprint.
`benchmarks/nvfp4_quality.py` measured the shipped bf16-trained drafter on it; this script retrains
that drafter on the NVFP4 target's own answers and measures both. Three steps, the first two the
`specloop` commands a user would run (recorded verbatim in the JSON):

1. `specloop generate --weights nvfp4`: the NVFP4 target answers the first `--prompts` prompts of
   the shipped drafter's prompt set (`--source evals --per-task 8 --seed 0`, 256-token answers,
   held-out fraction 0.05: the same hash split, so its held-out prompts stay out of training).
2. `specloop train-drafter --weights nvfp4 --init-from` the shipped drafter: a warm start across
   base models (`daemon/training/drafter_init.py`), the shipped recipe's flags (fp32, block 4, 256
   anchors, distillation, trimmed vocabulary) with a warm start's lower peak LR and 1% warmup, for
   `--train-minutes`. The artifact is the NVFP4 model's; its lineage names the shipped drafter.
3. τ at block 4 by replay (`daemon/evaluation/replay.py`, equal to serving for greedy) over the NVFP4
   target's own greedy outputs on nvfp4_quality.py's held-out prompts (every 164/N-th HumanEval
   problem and the first N of the shipped drafter's 72 held-out evals prompts, `--new-tokens` each,
   its helpers): n-gram lookup, each drafter, each drafter + n-gram (min match 3, as eval-drafter).
   With `--control`, the same on the dense bf16 target's own outputs: whether a gain is the NVFP4
   target's or just more training. A drafter used with a model it was not trained for is loaded
   without the fingerprint check, on purpose.

Steps 1 and 2 are skipped when `--work` already holds their output (the JSON says so). Writes
`benchmarks/results/nvfp4_retrain.json` and prints a markdown table. Run:
`.venv/bin/python benchmarks/nvfp4_retrain.py` (42 minutes on 2 cores shared with another benchmark
here: generation 16, training 12.5, τ 11). This is not a test: it asserts nothing about τ.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # `benchmarks`; last, so that no folder of the checkout shadows a package
from benchmarks.machine import describe
from benchmarks.nvfp4_quality import drafter_heldout_evals, greedy, humaneval_chat_prompts, shown
from specloop.daemon.child_command import specloop_command
from specloop.daemon.evaluation.replay import replay
from specloop.engine.loaders.load import LoadedModel, load_for_inference
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter, read_meta
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.sequences import TokenSequence, read_sequences

RESULTS = Path(__file__).parent / "results" / "nvfp4_retrain.json"
SHIPPED = ROOT / "daemon" / "drafters" / "SmolLM2-135M-Instruct"
DEVICE = torch.device("cpu")
MIN_MATCH = 3  # eval-drafter's default


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "nvfp4_retrain", help="data and drafter")
    parser.add_argument("--prompts", type=int, default=256, help="evals prompts the NVFP4 target answers")
    parser.add_argument("--gen-concurrency", type=int, default=32)
    # fp32 answered 94 tok/s against 55 in bf16 in a 32-prompt probe here (bf16 products are emulated on
    # this CPU); the τ targets stay bf16, as served.
    parser.add_argument("--gen-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--train-minutes", type=float, default=12.0)
    parser.add_argument("--lr", type=float, default=1e-4, help="peak LR of the warm start (d9's)")
    parser.add_argument("--eval-prompts", type=int, default=20, help="greedy prompts from each of HumanEval and evals")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="sequences decoded together for the τ outputs")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure both drafters on the dense bf16 target")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for field in ("prompts", "gen_concurrency", "eval_prompts", "new_tokens", "concurrency"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if args.train_minutes <= 0 or args.lr <= 0:
        raise ValueError(f"--train-minutes and --lr must be > 0, got {args.train_minutes}, {args.lr}")
    return args


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The `specloop` arguments of steps 1 and 2."""
    data, drafter = args.work / "data", args.work / "drafter"
    return {
        "generate": ["generate", "--out", str(data), "--source", "evals", "--per-task", "8", "--seed", "0",
                     "--heldout-fraction", "0.05", "--max-tokens", "256", "--limit", str(args.prompts),
                     "--concurrency", str(args.gen_concurrency), "--dtype", args.gen_dtype, "--weights", "nvfp4"],
        "train-drafter": ["train-drafter", "--data", str(data / "train.jsonl"), "--out", str(drafter),
                          "--weights", "nvfp4", "--dtype", "float32", "--init-from", str(SHIPPED),
                          "--block-size", "4", "--anchors", "256", "--batch-size", "4", "--trim-vocab", "--distill",
                          "--lr", str(args.lr), "--warmup-ratio", "0.01", "--steps", "10000",
                          "--max-minutes", str(args.train_minutes), "--eval-every", "100",
                          "--heldout-fraction", "0.05", "--no-progress", "--no-resume"],
    }


def run_step(name: str, argv: list[str], done: Path) -> dict:
    """Run `specloop <argv>` unless `done` exists; its command line, wall time and whether it was reused."""
    line = "specloop " + shlex.join(shown_arg(a) for a in argv)
    if done.exists():
        print(f"{name}: reusing {shown(done)}", flush=True)
        return {"command": line, "reused": True}
    print(f"{name}: {line}", flush=True)
    started = time.perf_counter()
    subprocess.run(specloop_command(*argv), check=True, cwd=ROOT)
    return {"command": line, "reused": False, "seconds": round(time.perf_counter() - started, 1)}


def shown_arg(arg: str) -> str:
    return shown(Path(arg)) if arg.startswith("/") else arg


def prompt_sets(tok: Tokenizer, n: int) -> dict[str, list[list[int]]]:
    return {"humaneval": humaneval_chat_prompts(tok, n).prompts,
            "evals (drafter held-out)": [ids for ids, _ in drafter_heldout_evals(tok)[:n]]}


def measure(target: Transformer, drafters: dict[str, DFlashDrafter], prompts: list[list[int]],
            outputs: list[list[int]]) -> dict:
    """Replayed τ (and per-position acceptance) of n-gram lookup, each drafter and each with n-gram."""
    seqs = [TokenSequence(tuple(p), tuple(o)) for p, o in zip(prompts, outputs, strict=True)]
    block = {d.config.block_size for d in drafters.values()}
    assert len(block) == 1, block
    out = {"ngram": replay(NgramProposer(block.pop()), seqs).to_json()}
    for name, drafter in drafters.items():
        dflash = DFlashProposer(drafter, target)
        out[name] = replay(dflash, seqs, target).to_json()
        both = CombinedProposer(dflash, NgramProposer(dflash.block_size), MIN_MATCH)
        out[f"{name} + ngram"] = replay(both, seqs, target).to_json()
    return out


def target_rows(loaded: LoadedModel, trained_for: dict[str, str], sets: dict[str, list[list[int]]],
                args: argparse.Namespace) -> dict:
    """Both drafters on `loaded`'s own greedy outputs; each checked against the fingerprint it was
    trained for only where that is this target's."""
    started = time.perf_counter()
    drafters = {}
    for name, path in (("shipped", SHIPPED), ("retrained", args.work / "drafter")):
        expected = loaded.fingerprint if trained_for[name] == loaded.fingerprint else None
        drafters[name] = load_drafter(path, expected, DEVICE, loaded.model.dtype).drafter
    rows = {}
    for set_name, prompts in sets.items():
        outputs = greedy(loaded.model, prompts, args.new_tokens, args.concurrency, loaded.tokenizer.eos_token_ids)
        rows[set_name] = {"prompts": len(prompts), "generated_tokens": sum(map(len, outputs)),
                          "tau": measure(loaded.model, drafters, prompts, outputs)}
    return {"fingerprint": loaded.fingerprint, **loaded.weights.card(), "dtype": str(loaded.model.dtype),
            "sets": rows, "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    argv = commands(args)
    steps = {"generate": run_step("generate", argv["generate"], args.work / "data" / "stats.json"),
             "train-drafter": run_step("train-drafter", argv["train-drafter"], args.work / "drafter" / "drafter.json")}
    nvfp4 = load_for_inference(None, torch.bfloat16, DEVICE, WeightFormat("nvfp4"))
    sets = prompt_sets(nvfp4.tokenizer, args.eval_prompts)
    train = read_sequences([args.work / "data" / "train.jsonl"])
    leaked = {tuple(p) for ps in sets.values() for p in ps} & {s.prompt for s in train}
    assert not leaked, f"{len(leaked)} evaluation prompts are in the training data"
    retrained = read_meta(args.work / "drafter")
    trained_for = {"shipped": read_meta(SHIPPED)["base_model_fingerprint"],
                   "retrained": retrained["base_model_fingerprint"]}
    targets = {"nvfp4": target_rows(nvfp4, trained_for, sets, args)}
    del nvfp4
    if args.control:
        targets["bf16 (control)"] = target_rows(load_for_inference(None, torch.bfloat16, DEVICE), trained_for, sets,
                                                args)
    stats = json.loads((args.work / "data" / "stats.json").read_text())
    report = {
        "command": shlex.join(["benchmarks/nvfp4_retrain.py", *sys.argv[1:]]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": describe(),
        # Other work on the machine slows every step; the timings read against this.
        "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()],
        "settings": {k: shown(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "steps": steps,
        "data": {k: stats[k] for k in ("prompts", "train", "heldout", "response_tokens", "seconds",
                                       "tokens_per_second", "dtype", "weights", "base_model", "source_base_model")},
        "drafters": {"shipped": {"path": shown(SHIPPED), "base_model_fingerprint": trained_for["shipped"]},
                     "retrained": {"path": shown(args.work / "drafter"),
                                   "base_model_fingerprint": trained_for["retrained"],
                                   "output_vocab_size": retrained["config"]["output_vocab_size"],
                                   "lineage": retrained["lineage"]}},
        "targets": targets,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nwritten to {args.out}")


def markdown(report: dict) -> str:
    lines = ["| target | prompt set | n-gram | shipped | retrained | shipped + n-gram | retrained + n-gram |",
             "|" + " --- |" * 7]
    for target, row in report["targets"].items():
        for set_name, s in row["sets"].items():
            tau = s["tau"]
            cells = [tau[k]["tau"] for k in ("ngram", "shipped", "retrained", "shipped + ngram", "retrained + ngram")]
            lines.append(f"| {target} | {set_name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

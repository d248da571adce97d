"""The PII screen's recall and false positives, on the corpus it was tuned on and on draws it never saw.

Sets (`benchmarks/pii_corpus.py`):
- tuned: positives of seed 0 and the corpus's negatives (HumanEval, the formal-logic prompts,
  specloop's own sources and docs): the detectors were adjusted until these passed;
- held out: positives of `--heldout-seeds` (fresh values and sentences, the same ways of writing
  them), and `--evals-prompts` chat prompts sampled across OpenAI `evals` tasks as negatives, never
  looked at while tuning. Flagged evals prompts are listed with what was found, for a reader to judge
  (a prompt may hold real personal data: a task about formatting phone numbers does).
Per set: recall by kind and by way of writing, the share of negatives flagged, and screening time
per KB of negative text. With `--baseline REF`, the same for `consent/pii.py` as it was at that git
commit (loaded from `git show`), side by side.

Writes `benchmarks/results/pii_screen.json`. Not a test (tests/consent/test_pii_corpus.py holds the
thresholds); takes about a minute.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.pii_corpus import Sample, corpus  # noqa: E402
from specloop.consent.pii import scan  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "pii_screen.json"
Screen = Callable[[str], set[str]]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heldout-seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--evals-per-task", type=int, default=2, help="evals prompts per task (0: none)")
    p.add_argument("--evals-seed", type=int, default=3, help="seeds 1 and 2 were looked at while tuning (see the docs)")
    p.add_argument("--baseline", default=None, help="a git commit whose consent/pii.py to compare")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def measure(screen: Screen, positives: list[Sample], negatives: list[Sample]) -> dict:
    by_kind, by_variant, missed = Counter(), Counter(), Counter()
    for s in positives:
        assert s.kind is not None
        by_kind[s.kind.value] += 1
        by_variant[s.variant] += 1
        if s.kind.value not in screen(s.text):
            missed[s.kind.value, s.variant] += 1
    started = time.perf_counter()
    flagged = [(s, screen(s.text)) for s in negatives]
    seconds = time.perf_counter() - started
    false = [(s, kinds) for s, kinds in flagged if kinds]
    kb = sum(len(s.text.encode()) for s in negatives) / 1024
    return {
        "positives": len(positives), "recall": round(1 - sum(missed.values()) / len(positives), 4),
        "recall_by_kind": {k: round(1 - sum(v for (kk, _), v in missed.items() if kk == k) / n, 4)
                           for k, n in sorted(by_kind.items())},
        "missed_by_variant": {f"{k}: {v}": f"{n}/{by_variant[v]}" for (k, v), n in sorted(missed.items())},
        "negatives": len(negatives), "negative_kb": round(kb, 1),
        "false_positive_rate": round(len(false) / len(negatives), 4),
        "false_positives_by_source": dict(Counter(s.variant for s, _ in false)),
        "ms_per_kb": round(seconds * 1e3 / kb, 4),
    }


def flagged_examples(negatives: list[Sample]) -> list[dict]:
    out = []
    for s in negatives:
        found = scan(s.text)
        if found:
            out.append({"source": s.variant, "found": [(f.kind.value, s.text[f.start:f.end]) for f in found[:3]]})
    return out


def baseline_screen(ref: str) -> Screen:
    """`consent/pii.py` at git commit `ref`, imported from a temporary file (it used the standard library only)."""
    source = subprocess.run(["git", "show", f"{ref}:consent/pii.py"], check=True, capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "pii_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("pii_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda text: {f.kind.value for f in module.findings(text)}


def main() -> None:
    args = parse_args()
    screens: dict[str, Screen] = {"current": lambda text: {f.kind.value for f in scan(text)}}
    if args.baseline:
        screens[f"baseline {args.baseline}"] = baseline_screen(args.baseline)
    tuned_pos, negatives = corpus(0)
    heldout_pos = [s for seed in args.heldout_seeds for s in corpus(seed)[0]]
    drawn = prompt_set("evals", per_task=args.evals_per_task, seed=args.evals_seed) if args.evals_per_task else []
    evals = [Sample("\n".join(m["content"] for m in p.messages), None, f"evals/{p.task.split('/')[0]}") for p in drawn]
    sets = {"tuned": (tuned_pos, negatives), "held out": (heldout_pos, evals)}
    result = {"machine": describe(), "sets": {}}
    for set_name, (pos, neg) in sets.items():
        result["sets"][set_name] = {name: measure(screen, pos, neg) for name, screen in screens.items()}
        print(set_name, json.dumps({n: {k: r[k] for k in ("recall", "false_positive_rate", "ms_per_kb")}
                                    for n, r in result["sets"][set_name].items()}), flush=True)
    result["held_out_negatives_flagged"] = flagged_examples(evals)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

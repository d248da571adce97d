"""A served weight format's first drafter, from nothing: how long the daemon takes to make it on this
machine, and what it decodes, side by side in one run.

The situation of `specloop up` with `--weights nvfp4` on a fresh machine: the registry holds the
shipped drafter of the dense model (seeded, as `up` seeds it) and no drafter for the NVFP4 model's own
fingerprint; no traces of any model are stored. One daemon run (`daemon/retrain/run.py`, the policy
given, `daemon/policies/demo.yaml` by default) makes the first drafter: the target answers the
shipped prompts (`data.first_drafter_prompts`), the drafter is warm-started from the dense model's
champion, trained within the policy's budget, judged against suffix decoding alone and registered.
Reported: each step's seconds, the gate's decision, the tags.

Then live, greedy, natural-length answers of at most `--max-tokens`, tok/s with the prefill included,
at concurrency 1 and 8, the target's plain decoding against suffix decoding alone (a fresh cache,
as at first start) and the first drafter + suffix decoding (what the engine serves once the alias
moves), on two held-out sets: the shipped drafter's 72 held-out `evals` prompts without those the
first drafter answered in training, and the demo's held-out formal-logic prompts. Every answer is
checked against plain decoding's. With `--llama-cpp-site DIR` (the site-packages of a venv holding
llama-cpp-python, appended to the path), llama.cpp on the GGUF's own Q4_1 weights answers the same
prompts one at a time beside them, greedy, stopping at its end-of-sequence token: the reference
engine users would run instead.

Writes `benchmarks/results/first_drafter.json` (with the CPU, `benchmarks/machine.py`). Not a test:
it asserts nothing and takes about 15 minutes on 2 cores with the demo policy.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from specloop.daemon.retrain.history import PromotionHistory
from specloop.daemon.retrain.policy import load_policy
from specloop.daemon.retrain.run import Loop, RetrainRun, new_run_id
from specloop.daemon.retrain.run_log import RunLog
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.shipped_drafters import seed_registry
from specloop.daemon.traffic.sender import traffic_split
from specloop.daemon.training.prompts import FIRST_DRAFTER, prompt_set, read_prompts
from specloop.engine.loaders.load import default_model_path, load_for_inference
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.drafter_artifact import load_drafter, max_artifact_bytes
from specloop.engine.speculation.suffix_cache import SuffixCache
from specloop.storage.registry import DrafterRegistry

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.shipped_drafter_prompts import round1  # noqa: E402
from benchmarks.suffix_decoding import live  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "first_drafter.json"
POLICY = Path(__file__).resolve().parents[1] / "daemon" / "policies" / "demo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", type=Path, default=POLICY)
    parser.add_argument("--live-prompts", type=int, default=16, help="held-out prompts per set, generated live")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--llama-cpp-site", type=Path, default=None,
                        help="site-packages with llama_cpp: adds llama.cpp at batch 1 on the same prompts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    weights = WeightFormat("nvfp4", lm_head=True)
    data = Path(tempfile.mkdtemp(prefix="specloop-first-drafter-"))
    registry = DrafterRegistry(f"sqlite:///{data / 'mlflow.db'}", data / "artifacts")
    seeded = seed_registry(registry)
    target = load_for_inference(None, torch.bfloat16, torch.device("cpu"), weights)
    settings = DaemonSettings(policy=args.policy, registry=registry.tracking_uri, traces_root=data / "traces",
                              consent_db=data / "consent.db", state_db=f"sqlite:///{data / 'state.db'}",
                              work_dir=data / "runs", weights="nvfp4", nvfp4_lm_head=True)
    db = open_state(settings.state_db)
    policy = load_policy(args.policy)
    loop = Loop(policy, settings, registry, target, RunLog(db), PromotionHistory(db))
    report: dict = {"machine": describe(), "weights": weights.card(), "policy": str(args.policy),
                    "seeded": [f"{v.base_model} {v.label}" for v in seeded], "target": target.fingerprint,
                    "source_fingerprint": target.source_fingerprint}
    started = time.monotonic()
    RetrainRun(loop, new_run_id(), threading.Event()).execute()
    record = loop.runs.runs()[-1]
    report["run"] = {"seconds": round(time.monotonic() - started, 1), "outcome": record.outcome.value,
                     "detail": record.detail, "timings": {k: round(v, 1) for k, v in record.timings.items()},
                     "first_drafter_prompts": policy.data.first_drafter_prompts}
    print(json.dumps(report["run"], indent=2), flush=True)
    (version,) = registry.versions(target.fingerprint)
    report["version"] = {"label": version.label, "tags": dict(version.tags)}
    drafter = load_drafter(registry.download(version, data / "drafters", max_artifact_bytes(target.model.config)),
                           target.fingerprint, target.model.device, target.model.dtype).drafter
    sets = held_out_sets(target, args.live_prompts)
    report["live"] = {name: measure(target, drafter, prompts, args) for name, prompts in sets.items()}
    if args.llama_cpp_site is not None:
        report["llama_cpp"] = llama_cpp(args.llama_cpp_site, sets, args.max_tokens)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["live"], indent=2))


def held_out_sets(target, count: int) -> dict[str, list[list[int]]]:
    """Chat-templated prompt ids of each held-out set, none of which the first drafter answered in training."""
    tok = target.tokenizer
    trained = {json.dumps(list(p.messages), sort_keys=True) for p in read_prompts(FIRST_DRAFTER)}
    rows, held = round1(tok)
    evals = [list(ids) for ids, p in rows
             if ids in held and json.dumps(list(p.messages), sort_keys=True) not in trained]
    _, formal = traffic_split(prompt_set("formal-logic"), 0.25)  # what `make run`'s traffic never sends
    formal_ids = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in formal]
    return {"evals held out": evals[:count], "formal-logic held out": formal_ids[:count]}


def measure(target, drafter, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    out: dict = {"prompts": len(prompts)}
    for c in args.concurrency:
        plain_s, _, plain_out = live(target, None, prompts, c, args.max_tokens)
        row = {"plain": {"tokens_per_s": round(plain_s, 1)}}
        for name in ("suffix", "dflash+suffix"):
            proposer = build_proposer(name, target.model, drafter if name != "suffix" else None,
                                      suffix_cache=SuffixCache())
            tok_s, tau, outputs = live(target, proposer, prompts, c, args.max_tokens)
            row["first drafter + suffix" if name != "suffix" else "suffix alone"] = {
                "tokens_per_s": round(tok_s, 1), "speedup": round(tok_s / plain_s, 3),
                "tau": round(tau, 3) if tau else None, "lossless": outputs == plain_out}
        out[f"c{c}"] = row
        print(f"c{c}", json.dumps(row), flush=True)
    return out


def llama_cpp(site: Path, sets: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """llama.cpp's tok/s (prefill included) on each set, one prompt at a time, greedy, as `live` counts."""
    sys.path.append(str(site))  # last: this venv's numpy and torch win
    import llama_cpp as llama

    llm = llama.Llama(model_path=str(default_model_path()), n_ctx=2048, n_threads=torch.get_num_threads(),
                      verbose=False)
    out = {"version": llama.__version__}
    for name, prompts in sets.items():
        generated, started = 0, time.perf_counter()
        for prompt in prompts:
            for n, token in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
                generated += 1
                if token == llm.token_eos() or n == max_tokens:
                    break
        out[name] = {"c1": {"tokens_per_s": round(generated / (time.perf_counter() - started), 1),
                            "tokens": generated}}
        print("llama.cpp", name, json.dumps(out[name]), flush=True)
    return out


if __name__ == "__main__":
    main()

"""One retraining cycle, measured against suffix decoding alone: `specloop up --demo` (what `make run`
starts) on any prompt set, until the daemon's gate has decided on a drafter retrained on that traffic;
then the retrained drafter + suffix decoding against the shipped drafter + suffix decoding and
suffix decoding alone (no training), side by side.

The traffic (`--prompts`: the demo's formal-logic prompts by default, HumanEval code prompts, a
broad chat mix of 220 prompts from 220 `evals` tasks, or `--prompts file --prompts-file F`) is sent by
`specloop replay`,
which holds out a share of the prompts by hash and never sends them
(`specloop.daemon.traffic.sender.traffic_split`). Measured on exactly those held-out prompts:

- live through the server: τ of the held-out prompts sent anonymously (never captured) before the
  cycle and again once the engine serves the promoted drafter (or, when the run benched the champion or
  left none, suffix decoding alone), the champion's tags after the cycle, and live τ of the demo traffic itself
  per drafter version, from the replay's records;
- after the stack stops, per system (suffix alone, v1 + suffix, the retrained drafter + suffix), each
  with a fresh suffix cache warmed by the run's consented traces (what serving held when it swapped):
  - live: the first `--live-prompts` held-out prompts generated greedily by the engine at each
    `--concurrency`, every engine pricing its verify passes by one measurement made for them all,
    plain decoding, every system and (at concurrency 1) llama.cpp interleaved by chunks of twice the
    concurrency, the order rotating (`benchmarks/suffix_decoding.py`, `interleaved`); tokens/s =
    generated tokens / wall seconds of the system's chunks (prefill included), against plain decoding
    and llama.cpp in the same run; τ from the engine's counters; whether the tokens equal plain
    decoding's;
    and the retrained drafter + suffix once more with DFlash writing its context at every step (as
    before it held observed rows until it drafts), to show what holding them saves;
  - replayed: the target's greedy answers to every held-out prompt replayed 8 at a time in order
    (`daemon/evaluation/replay.py`), τ per position and the decode speed the daemon's contest models
    from this machine's step costs, with the paired-bootstrap gain over suffix alone.
- the loop's gain: the retrained drafter + suffix over suffix alone, τ and tokens/s, live and replayed;
- per `--weights` (`gguf`, what `make run` serves the SmolLM2 GGUF as, by default; `dense gguf`: both
  formats with the file's base-model identity), all of the above once per way the measured target
  holds its weights (the cycle itself serves and trains as `make run` does: weights `auto`, so `gguf`
  on a CPU where the kernel builds). With `--serve nvfp4` the whole stack serves and trains NVFP4 with
  its LM head (another base model, for which nothing ships): the daemon's first run makes its first
  drafter (bootstrapped from the shipped one's model, `daemon/retrain/bootstrap.py`), the cycle measured
  is its second, on the demo traffic, and `v1` is the bootstrapped drafter; `--weights nvfp4` measures
  it. Where `llama_cpp` is installed, llama.cpp on the GGUF's own weights
  generating the same live prompts greedily at batch 1, interleaved with the systems, the column every
  concurrency-1 row is set against (issue 37's comparison); and, in a run of its own before, llama.cpp
  plain and with its own speculative mode (prompt lookup);
- with `--other-recipe`, beside them a drafter trained afterwards on the run's own training traces,
  warm start, seed and budget with the demo policy's `training.skip_suffix_covered` flipped (anchoring
  blocks, or not, where suffix decoding drafts in the drafter's place), and its gain over suffix alone.

Also reported: the cycle's wall-clock from the trigger (the run's start) to the gate's decision, each
step's seconds, the gate's verdict and reason. A refused challenger is measured all the same (it is
registered, never served). Writes `benchmarks/results/retrain_cycle.json` (`--out`) and copies the
daemon's live-τ PNG beside it. `--again RESULT_JSON` runs no cycle and measures the systems again on
the one an earlier result file records, while its data directory still exists. Run:
`.venv/bin/python benchmarks/retrain_cycle.py` (about 30-40 minutes on 2 cores). This is not a test:
it asserts nothing.
"""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.server_process import wait_ready  # noqa: E402
from specloop.daemon.traffic.sender import traffic_split  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402
from specloop.engine.loaders.weight_format import WeightFormat  # noqa: E402
from specloop.storage.broker import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HELDOUT_FRACTION = 0.25  # `specloop replay`'s default, which `specloop up --demo` uses
MAX_TOKENS = 192  # as the demo traffic
CONCURRENCY = 4  # the demo traffic's
SUFFIX, SHIPPED, RETRAINED = "suffix", "v1 (shipped) + suffix", "retrained + suffix"
BOOTSTRAPPED = "v1 (bootstrapped) + suffix"  # `--serve nvfp4`: the first drafter the daemon made
# `--serve nvfp4`: the NVFP4 target with its LM head (issue 37's fastest `nvfp4` variant), as every
# command of the stack reads it from the environment (`SPECLOOP_WEIGHTS`, `SPECLOOP_NVFP4_LM_HEAD`)
NVFP4_SERVED = {"SPECLOOP_WEIGHTS": "nvfp4", "SPECLOOP_NVFP4_LM_HEAD": "true"}
# Live only: the retrained drafter + suffix with DFlash writing what it observes at every step, as it
# did before it held the rows until it drafts (`engine/speculation/dflash_proposer.py`)
WRITING = "retrained + suffix, written every step"
RECIPE = "retrained, other recipe + suffix"  # `--other-recipe`: skip_suffix_covered flipped
PLAIN, LLAMA_CPP = "plain", "llama.cpp"
# llama.cpp's prompt lookup, tokens drafted per step: its binding's default, and what its docs
# suggest on a CPU-only machine.
LOOKUP_DRAFTS = (10, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "retrain_cycle.json")
    parser.add_argument("--timeout-min", type=float, default=45.0, help="Give up waiting for the gate's decision")
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temporary directory")
    parser.add_argument("--prompts", choices=["formal-logic", "humaneval", "evals-mix", "file"],
                        default="formal-logic", help="The demo traffic's prompt set (`specloop up --demo-prompts`)")
    parser.add_argument("--prompts-file", type=Path, default=None, help='--prompts file: JSONL of {"messages": [...]}')
    parser.add_argument("--live-prompts", type=int, default=32, help="held-out prompts generated live per system")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--serve", choices=["auto", "nvfp4"], default="auto",
                        help="how the stack serves and trains the target: as `make run` does, or NVFP4 with its "
                             "LM head (the daemon's second run is the cycle measured; the first makes v1)")
    parser.add_argument("--weights", nargs="*", choices=["dense", "gguf", "nvfp4"], default=None,
                        help="how the measured target holds its weights, each measured in turn: formats with "
                             "the served model's base-model identity, so the run's drafters serve on them "
                             "(default: gguf, or nvfp4 with --serve nvfp4; none: llama.cpp alone, as with "
                             "`--again` to add its column to a run)")
    parser.add_argument("--other-recipe", action="store_true",
                        help="also train, after the cycle, a drafter on the run's dataset with the policy's "
                             "`training.skip_suffix_covered` flipped (same seed, warm start and budget), "
                             "measured beside")
    parser.add_argument("--again", type=Path, default=None, metavar="RESULT_JSON",
                        help="run no cycle: measure the systems again on the one an earlier result file records "
                             "(its data directory must still exist; pass its --prompts)")
    args = parser.parse_args()
    if args.again is not None and args.other_recipe:
        parser.error("--other-recipe trains after a cycle; --again runs none")
    earlier = json.loads(args.again.read_text()) if args.again is not None else None
    if earlier is not None:
        args.serve = earlier.get("served", args.serve)  # a cycle served NVFP4 is measured on NVFP4
    nvfp4 = args.serve == "nvfp4"
    if nvfp4 and args.other_recipe:
        parser.error("--other-recipe warm-starts from the shipped drafter, which serves no NVFP4 target")
    if args.weights is None:
        args.weights = ["nvfp4"] if nvfp4 else ["gguf"]
    if any((kind == "nvfp4") != nvfp4 for kind in args.weights):
        parser.error("--weights nvfp4 measures the drafters of a cycle served as nvfp4 (--serve nvfp4), and only those")
    data = Path(earlier["data_dir"]) if earlier else args.data_dir or Path(tempfile.mkdtemp(prefix="specloop-cycle-"))
    data.mkdir(parents=True, exist_ok=True)
    label = str(args.prompts_file or args.prompts)
    if args.prompts == "evals-mix":
        args.prompts, args.prompts_file = "file", evals_mix(data / "evals-mix.jsonl")
    _, heldout = traffic_split(prompt_set(args.prompts, args.prompts_file), HELDOUT_FRACTION)
    report: dict = {"machine": describe(), "prompts": label, "heldout_prompts": len(heldout), "data_dir": str(data),
                    "served": args.serve}
    if earlier:
        report.update({"again": str(args.again), "run": earlier["run"], "gate": earlier["gate"],
                       **{k: earlier[k] for k in ("first_drafter",) if k in earlier}})
    else:
        report.update(cycle(data, args, heldout))
    recipe = other_recipe(data, report["run"]["run_id"]) if args.other_recipe else None
    if recipe is not None:
        report["other_recipe"] = recipe[1]
    if 1 in args.concurrency:
        report["llama_cpp_c1"] = llama_cpp_live(heldout[:args.live_prompts])
    report["measured"] = {kind: systems(data, report["run"]["run_id"], heldout, report["gate"]["version"],
                                        args.live_prompts, args.concurrency, measured_format(kind),
                                        None if recipe is None else recipe[0])
                          for kind in args.weights}
    for measured in report["measured"].values():
        measured["vs_llama_cpp_c1"] = _vs_llama_cpp(measured["live_systems"])
    png = data / "daemon" / "live_tau.png"
    if png.exists() and not earlier:
        shutil.copy(png, args.out.with_name(f"{args.out.stem}_live_tau.png"))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {kind: {k: m.get(k) for k in ("loop_gain", "other_recipe_gain", "vs_llama_cpp_c1")}
               for kind, m in report["measured"].items()}
    print(json.dumps({"cycle_seconds": report.get("cycle_seconds"), "gate": report.get("gate"),
                      "llama_cpp_c1": report.get("llama_cpp_c1"), **summary}, indent=2))


def measured_format(kind: str) -> WeightFormat:
    return WeightFormat(kind, lm_head=True) if kind == "nvfp4" else WeightFormat(kind)


def cycle(data: Path, args: argparse.Namespace, heldout: list) -> dict:
    """`specloop up --demo` on `data` until the gate has decided on the cycle (served NVFP4: the second
    decision; the first is the bootstrapped v1's): the run, the gate's event, live τ of the held-out
    prompts before and after, the champion after, and live τ of the demo's own traffic."""
    nvfp4 = args.serve == "nvfp4"
    port, daemon_port = free_port(), free_port()
    url, daemon = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{daemon_port}"
    log = data / "up.log"
    report: dict = {}
    source = ["--demo-prompts", args.prompts] + (["--demo-prompts-file", str(args.prompts_file)]
                                                 if args.prompts_file else [])
    started = time.monotonic()
    with open(log, "ab") as out:
        up = subprocess.Popen([str(Path(sys.executable).with_name("specloop")), "up", "--demo", "--port", str(port),
                               "--mlflow-port", "0", "--daemon-port", str(daemon_port), *source],
                              env={**os.environ, "SPECLOOP_DATA_DIR": str(data), **(NVFP4_SERVED if nvfp4 else {})},
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, up, log, 600)
        first = None
        if nvfp4:  # nothing ships for it: the daemon's first run makes v1, which the cycle then starts from
            first = wait_for_decision(daemon, up, log, args.timeout_min * 60)
            report["first_drafter"] = first
            wait_serving(url, serving(status_champion(daemon), first["event"]), 120)
        else:
            wait_serving(url, "v1", 120)  # the registry follower's first look comes after the server is ready
        report["live_heldout_before"] = live_tau(url, heldout)
        decided = wait_for_decision(daemon, up, log, args.timeout_min * 60, after=first and first["event"])
        report["run"] = decided["run"]
        report["gate"] = decided["event"]
        report["cycle_seconds"] = decided["cycle_seconds"]
        version = decided["event"]["version"]
        report["champion_after"] = status_champion(daemon)
        after = serving(report["champion_after"], decided["event"])
        if after is None or after == version:  # what the decision made serve, from the follower's next look
            wait_serving(url, after, 120)
            report["live_heldout_after"] = live_tau(url, heldout)
        report["wall_clock_s"] = round(time.monotonic() - started, 1)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(300)
    report["live_traffic"] = traffic_tau(data / "demo" / "traffic.jsonl")
    return report


def evals_mix(path: Path, count: int = 220, max_chars: int = 2000) -> Path:
    """A broad chat mix written to `path`: `count` prompts of at most `max_chars` characters, each
    from a different OpenAI `evals` task (one sampled per task, seed 0, then shuffled, seed 0)."""
    import random

    one_per_task = [p for p in prompt_set("evals", per_task=1, seed=0)
                    if sum(len(m["content"]) for m in p.messages) <= max_chars]
    random.Random(0).shuffle(one_per_task)
    path.write_text("".join(json.dumps({"messages": list(p.messages)}, ensure_ascii=False) + "\n"
                            for p in one_per_task[:count]))
    return path


def live_tau(url: str, prompts: list) -> dict:
    """Greedy answers to `prompts` from the engine, anonymous (never captured); τ pooled over them."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]

    def one(p: object) -> dict:
        body = {"model": model["id"], "messages": list(p.messages), "max_tokens": MAX_TOKENS, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"].get("speculation") or {"drafts": 0, "accepted_tokens": 0}

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        spec = list(pool.map(one, prompts))
    drafts, accepted = sum(s["drafts"] for s in spec), sum(s["accepted_tokens"] for s in spec)
    return {"drafter_version": model["drafter_version"], "tau": round(1 + accepted / max(drafts, 1), 3),
            "verify_steps": drafts, "accepted_tokens": accepted, "requests": len(spec)}


def status_champion(daemon: str) -> dict | None:
    return httpx.get(f"{daemon}/status", timeout=10).json()["champion"]


def serving(champion: dict | None, event: dict) -> str | None:
    """The drafter version engines serve after gate `event`, the daemon's `champion` then: none (suffix
    decoding alone) while there is no champion or it is benched, the promoted version, or the champion
    that stood."""
    if champion is None or champion["benched"]:
        return None
    return event["version"] if event["action"] == "promoted" else champion["version"]


def wait_for_decision(daemon: str, up: subprocess.Popen, log: Path, timeout_s: float,
                      after: dict | None = None) -> dict:
    """The first gate event (promoted or refused) later than the event `after` (None: the first), its
    run and the seconds from its start."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"specloop up exited with {up.returncode}: {log.read_text()[-3000:]}")
        try:
            status = httpx.get(f"{daemon}/status", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            time.sleep(5)
            continue
        events = sorted((e for e in status["history"] if e["action"] in ("promoted", "refused")
                         and (after is None or e["at"] > after["at"])), key=lambda e: e["at"])
        if events:
            event = events[0]
            run = next(r for r in status["last_runs"] if r["version"] == event["version"].removeprefix("v"))
            cycle = datetime.fromisoformat(event["at"]) - datetime.fromisoformat(run["started_at"])
            return {"event": event, "run": run, "cycle_seconds": round(cycle.total_seconds(), 1)}
        time.sleep(5)
    raise TimeoutError(f"no gate decision within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


def wait_serving(url: str, version: str | None, timeout_s: float) -> None:
    """Until new requests draft with `version` (None: no drafter, as when the champion is benched)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"] != version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine does not serve {version}")
        time.sleep(1)


def traffic_tau(records: Path) -> dict:
    by_version: dict[str, list[int]] = {}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r["status"] == 200:
            counts = by_version.setdefault(r["drafter_version"] or "none", [0, 0, 0])
            counts[0] += r["drafts"] or 0
            counts[1] += r["accepted_tokens"] or 0
            counts[2] += 1
    return {v: {"tau": round(1 + a / max(d, 1), 3), "verify_steps": d, "requests": n}
            for v, (d, a, n) in by_version.items()}


def other_recipe(data: Path, run_id: str) -> tuple[Path, dict]:
    """A drafter trained as the daemon's run was (its training traces, the shipped drafter as warm start,
    its seed, dtype and budget), with `training.skip_suffix_covered` flipped; its artifact and settings."""
    import threading

    import torch

    from specloop.daemon.retrain.challenger import train_challenger, train_config, training_dtype
    from specloop.daemon.retrain.policy import load_policy
    from specloop.daemon.retrain.run import run_seed
    from specloop.daemon.shipped_drafters import shipped_drafters
    from specloop.engine.loaders.load import load_for_inference, resolve_device
    from specloop.storage.sequences import read_sequences

    policy = load_policy(Path(__file__).resolve().parents[1] / "daemon" / "policies" / "demo.yaml")
    skip = not policy.training.skip_suffix_covered
    dtype = training_dtype(policy.training.dtype)
    loaded = load_for_inference(None, getattr(torch, dtype), resolve_device(None), WeightFormat("auto"))  # daemon's
    # in arrival order, as the run read it
    train = read_sequences([data / "daemon" / "runs" / run_id / "dataset" / "train.parquet"])
    cfg = train_config(policy.training.model_copy(update={"skip_suffix_covered": skip}), data / "bench" / "recipe",
                       shipped_drafters()[loaded.fingerprint], run_seed(run_id), dtype, len(train))
    started = time.monotonic()
    result = train_challenger(cfg, loaded.model, loaded.fingerprint, train, lambda: None, threading.Event())
    print("other recipe trained", result.steps, "steps", flush=True)
    return result.artifact, {"skip_suffix_covered": skip, "train_traces": len(train), "steps": result.steps,
                             "stop_reason": result.stop_reason, "seconds": round(time.monotonic() - started, 1)}


def systems(data: Path, run_id: str, heldout: list, version: str, live_prompts: int,
            concurrency: list[int], weights: WeightFormat, recipe: Path | None = None) -> dict:
    """Suffix alone, v1 + suffix and the retrained drafter + suffix (and the other recipe's) on the
    held-out prompts, live and replayed, each over a fresh suffix cache warmed by the run's consented
    traces, on a target holding its weights as `weights` says (its own plain decoding the reference)."""
    import torch

    from benchmarks.suffix_decoding import engine_system, interleaved, shared_verify_cost
    from specloop.daemon.evaluation.replay import NAMESPACE, replay
    from specloop.daemon.evaluation.speed_gain import paired_speed_gain
    from specloop.daemon.evaluation.step_cost import CostModel
    from specloop.daemon.shipped_drafters import shipped_drafters
    from specloop.engine.loaders.load import load_for_inference, resolve_device
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams
    from specloop.engine.speculation.build import build_proposer, dflash_of
    from specloop.engine.speculation.drafter_artifact import load_drafter, max_artifact_bytes
    from specloop.engine.speculation.proposer import Proposer
    from specloop.engine.speculation.suffix_cache import SuffixCache
    from specloop.storage.registry import DrafterRegistry
    from specloop.storage.sequences import TokenSequence, read_sequences

    loaded = load_for_inference(None, torch.bfloat16, resolve_device(None), weights)
    target, tok = loaded.model, loaded.tokenizer
    ids = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in heldout]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    out = LLMEngine(target, EngineConfig(num_slots=8, max_len=2048), tok.eos_token_ids).generate(ids, greedy)
    answers = [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in out]
    dataset = data / "daemon" / "runs" / run_id / "dataset"
    earlier = [s.tokens for s in read_sequences([dataset / "train.parquet", dataset / "eval.parquet"])]
    registry = DrafterRegistry(f"sqlite:///{(data / 'registry' / 'mlflow.db').resolve()}",
                               data / "registry" / "artifacts")
    retrained = registry.version(loaded.fingerprint, version.removeprefix("v"))
    bench = data / "bench" / weights.kind
    shipped = shipped_drafters().get(loaded.fingerprint)
    first = ({SHIPPED: shipped} if shipped is not None else  # served NVFP4: the daemon's first drafter
             {BOOTSTRAPPED: registry.download(registry.version(loaded.fingerprint, "1"), bench,
                                              max_artifact_bytes(target.config))})
    artifacts = {**first, RETRAINED: registry.download(retrained, bench, max_artifact_bytes(target.config))}
    if recipe is not None:
        artifacts[RECIPE] = recipe
    names = (SUFFIX, *artifacts)
    drafters = {name: load_drafter(path, loaded.fingerprint, target.device, target.dtype).drafter
                for name, path in artifacts.items()}

    def proposer(name: str, namespace: str) -> Proposer:
        cache = SuffixCache()
        for tokens in earlier:
            cache.add(namespace, tokens)
        if name == SUFFIX:
            return build_proposer("suffix", target, suffix_cache=cache)
        built = build_proposer("dflash+suffix", target, drafters[RETRAINED if name == WRITING else name],
                               suffix_cache=cache)
        if name == WRITING:
            dflash_of(built).held_positions = 0
        return built

    costs = CostModel(target, [list(s.tokens) for s in answers[:8]], NAMESPACE)
    replayed = {}
    for name in names:
        p = proposer(name, NAMESPACE)
        replayed[name] = replay(p, answers, target, cost=costs.cost(p))
        print("replayed", weights.kind, name, round(replayed[name].tau, 3), round(replayed[name].tokens_per_s, 1),
              flush=True)
    live = {}
    prompts = ids[:live_prompts]
    llama = llama_cpp_system(prompts[0]) if 1 in concurrency else None
    for c in concurrency:
        price = shared_verify_cost(loaded, c)  # one calibration: the width rule then differs by proposer only
        # generate() serves tenant "": each proposer's cache holds the warm traces under that name
        served = {name: proposer(name, "") for name in (*names, WRITING)}
        runs = {PLAIN: engine_system(loaded, None, c, MAX_TOKENS, price),
                **{name: engine_system(loaded, p, c, MAX_TOKENS, price) for name, p in served.items()},
                **({LLAMA_CPP: llama} if c == 1 and llama is not None else {})}
        totals = interleaved(runs, prompts, 2 * c)
        plain = totals[PLAIN]
        row = {name: {"tokens_per_s": round(totals[name].tokens_per_s, 1)} for name in (PLAIN, LLAMA_CPP)
               if name in runs}
        for name, p in served.items():
            t = totals[name]
            row[name] = {"tokens_per_s": round(t.tokens_per_s, 1),
                         "speedup": round(t.tokens_per_s / plain.tokens_per_s, 3),
                         "tau": round(t.tau, 3) if t.tau else None, "lossless": t.outputs == plain.outputs,
                         **_dflash_rows(p)}
            print("live", weights.kind, f"c{c}", name, json.dumps(row[name]), flush=True)
        live[f"c{c}"] = row
    gains = {name: paired_speed_gain(replayed[SUFFIX].seconds, replayed[name].seconds).to_json()
             for name in names[1:]}
    return {
        **weights.card(),
        "retrained_version": retrained.label, "retrained_tags": dict(retrained.tags),
        "warm_traces": len(earlier), "replayed_heldout": {
            "sequences": len(answers), "response_tokens": sum(len(s.response) for s in answers),
            "systems": {name: {"tau": round(st.tau, 3), "modelled_tokens_per_s": round(st.tokens_per_s, 1),
                               "per_position_acceptance": [round(a, 3)
                                                           for a in st.to_json()["per_position_acceptance"]],
                               **({"modelled_gain_over_suffix": {k: round(v, 3) for k, v in gains[name].items()}}
                                  if name in gains else {})}
                        for name, st in replayed.items()}},
        "live_systems": {"prompts": len(prompts), "max_tokens": MAX_TOKENS, **live},
        "loop_gain": _loop_gain(replayed, live),
        **({"other_recipe_gain": _loop_gain(replayed, live, RECIPE)} if RECIPE in replayed else {}),
    }


def llama_cpp_live(prompts: list) -> dict:
    """llama.cpp (`llama_cpp`, on the GGUF's own weights) answering `prompts` greedily one at a time, as
    the engine's live rows do: generated tokens over wall seconds, prefill included, at most
    `MAX_TOKENS` each and ending at end-of-sequence; plain, then with the speculative mode its binding
    offers, prompt lookup (`LlamaPromptLookupDecoding`: the last 2 tokens matched in the request's own
    context) drafting `LOOKUP_DRAFTS` tokens, each checked to answer as plain does. Its answers are its
    own (other numerics), so they are not compared with the engine's. {} where llama_cpp is not
    installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {}
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specloop.engine.loaders.load import read_stored_model

    path, stored = read_stored_model(None)
    tok = stored.tokenizer
    ids = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in prompts]
    seconds, plain = _llama_cpp_answers(path, ids, set(tok.eos_token_ids), None)
    out = {"prompts": len(ids), "generated_tokens": sum(map(len, plain)),
           "tokens_per_s": round(sum(map(len, plain)) / seconds, 1), "prompt_lookup": {}}
    for drafts in LOOKUP_DRAFTS:
        seconds, answers = _llama_cpp_answers(path, ids, set(tok.eos_token_ids),
                                              LlamaPromptLookupDecoding(num_pred_tokens=drafts))
        out["prompt_lookup"][str(drafts)] = {"tokens_per_s": round(sum(map(len, answers)) / seconds, 1),
                                             "answers_equal_plain": sum(a == b for a, b in zip(answers, plain))}
    return out


def llama_cpp_system(warm: list[int]) -> Callable[[list[list[int]]], list[tuple[list[int], int, int]]] | None:
    """llama.cpp plain on the GGUF's own weights as one of the live systems (`interleaved`, concurrency
    1): its greedy answers one at a time, as `llama_cpp_live`'s, after one warm-up answer to `warm`.
    None where llama_cpp is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from specloop.engine.loaders.load import read_stored_model

    path, stored = read_stored_model(None)
    _, answer = _llama_cpp(path, set(stored.tokenizer.eos_token_ids), None)
    answer(warm)
    return lambda chunk: [(answer(prompt), 0, 0) for prompt in chunk]


def _llama_cpp(path: Path, eos: set[int], draft: object) -> tuple[object, Callable[[list[int]], list[int]]]:
    """A llama.cpp model on `path` (a thread per core, as the engine) and its greedy answer to one
    prompt: at most `MAX_TOKENS`, ending at end-of-sequence."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False, draft_model=draft)

    def answer(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if token in eos or len(tokens) == MAX_TOKENS:
                break
        return tokens

    return llm, answer


def _llama_cpp_answers(path: Path, ids: list[list[int]], eos: set[int], draft: object) -> tuple[float, list]:
    """Wall seconds for llama.cpp's greedy answers to `ids`, one at a time (after one warm-up answer, as
    the engine measures its pass before its timed run), and the answers."""
    llm, answer = _llama_cpp(path, eos, draft)
    answer(ids[0])
    started = time.perf_counter()
    answers = [answer(prompt) for prompt in ids]
    seconds = time.perf_counter() - started
    llm.close()
    return seconds, answers


def _dflash_rows(served: object) -> dict:
    """Of the rows a combined proposer drafted for, those it asked DFlash for (suffix decoding short of
    its score) and those that took DFlash's draft: the share of steps a drafter can speed up at all."""
    from specloop.engine.speculation.combined import CombinedProposer

    if not isinstance(served, CombinedProposer):
        return {}
    return {"rows": served.rows_proposed, "dflash_asked": served.rows_asked, "dflash_drafted": served.rows_learned}


def _vs_llama_cpp(live: dict) -> dict:
    """Each live system's tokens/s at concurrency 1 over llama.cpp's, measured interleaved with them."""
    row = live.get("c1", {})
    if LLAMA_CPP not in row:
        return {}
    return {name: round(r["tokens_per_s"] / row[LLAMA_CPP]["tokens_per_s"], 3) for name, r in row.items()
            if name != LLAMA_CPP}


def _loop_gain(replayed: dict, live: dict, system: str = RETRAINED) -> dict:
    """`system` (the retrained drafter + suffix) over suffix alone: τ and tokens/s ratios − 1."""
    out = {"replayed_tau": round(replayed[system].tau / replayed[SUFFIX].tau - 1, 3),
           "replayed_modelled_tokens_per_s": round(replayed[system].tokens_per_s / replayed[SUFFIX].tokens_per_s
                                                   - 1, 3)}
    for c, row in live.items():
        if row[SUFFIX]["tau"] and row[system]["tau"]:
            out[f"live_{c}_tau"] = round(row[system]["tau"] / row[SUFFIX]["tau"] - 1, 3)
        out[f"live_{c}_tokens_per_s"] = round(row[system]["tokens_per_s"] / row[SUFFIX]["tokens_per_s"] - 1, 3)
    return out


if __name__ == "__main__":
    main()

"""One retraining cycle of the demo, measured: `specloop up --demo` (what `make run` starts) until the
daemon has promoted a drafter retrained on the demo's traffic and the engine serves it.

The traffic (`--prompts`: the demo's formal-logic prompts by default, or HumanEval code prompts)
comes from a domain the shipped drafter (trained on OpenAI `evals` chat prompts sampled across all
tasks) was not trained on. `specloop replay` holds out a share of the prompts by hash and never sends them
(`specloop.daemon.traffic.sender.traffic_split`); this script measures τ on exactly those:

- live: the held-out prompts sent to the engine anonymously (so never captured) before the cycle
  and again once the engine serves the promoted drafter, τ pooled from each response's
  `usage.speculation`; and live τ of the demo traffic itself, per drafter version, from the replay's
  records;
- replayed: after the stack stops, the target's greedy answers to the held-out prompts, replayed
  with n-gram lookup, suffix decoding, each drafter alone and each combined with each lookup (with
  suffix decoding is what serving uses),
  for the shipped drafter (v1) and the promoted one.

Also reported: the cycle's wall-clock from the trigger (the run's start) to the promotion, each
step's seconds, and the gate's numbers. Writes `benchmarks/results/retrain_cycle.json` and copies
the daemon's live-τ PNG beside it. Run: `.venv/bin/python benchmarks/retrain_cycle.py` (about 20-30
minutes on 2 cores). This is not a test.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.server_process import wait_ready  # noqa: E402
from specloop.daemon.traffic.sender import traffic_split  # noqa: E402
from specloop.daemon.training.prompts import prompt_set  # noqa: E402
from specloop.storage.broker import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HELDOUT_FRACTION = 0.25  # `specloop replay`'s default, which `specloop up --demo` uses
MAX_TOKENS = 192  # as the demo traffic
CONCURRENCY = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "retrain_cycle.json")
    parser.add_argument("--timeout-min", type=float, default=45.0, help="Give up waiting for a promotion")
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temporary directory")
    parser.add_argument("--prompts", choices=["formal-logic", "humaneval"], default="formal-logic",
                        help="The demo traffic's prompt set (`specloop up --demo-prompts`)")
    args = parser.parse_args()
    data = args.data_dir or Path(tempfile.mkdtemp(prefix="specloop-cycle-"))
    _, heldout = traffic_split(prompt_set(args.prompts), HELDOUT_FRACTION)
    port, daemon_port = free_port(), free_port()
    url, daemon = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{daemon_port}"
    log = data / "up.log"
    data.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": describe(), "prompts": args.prompts, "heldout_prompts": len(heldout),
                    "data_dir": str(data)}
    started = time.monotonic()
    with open(log, "ab") as out:
        up = subprocess.Popen([str(Path(sys.executable).with_name("specloop")), "up", "--demo", "--port", str(port),
                               "--mlflow-port", "0", "--daemon-port", str(daemon_port), "--demo-prompts", args.prompts],
                              env={**os.environ, "SPECLOOP_DATA_DIR": str(data)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, up, log, 600)
        wait_serving(url, "v1", 120)  # the registry follower's first look comes after the server is ready
        report["live_heldout_before"] = live_tau(url, heldout)
        promoted = wait_for_promotion(daemon, up, log, args.timeout_min * 60)
        report["run"] = promoted["run"]
        report["promotion"] = promoted["event"]
        report["cycle_seconds"] = promoted["cycle_seconds"]
        version = promoted["event"]["version"]
        wait_serving(url, version, 120)
        report["live_heldout_after"] = live_tau(url, heldout)
        report["wall_clock_s"] = round(time.monotonic() - started, 1)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(300)
    report["live_traffic"] = traffic_tau(data / "demo" / "traffic.jsonl")
    report["replayed_heldout"] = replayed(data, heldout, version)
    png = data / "daemon" / "live_tau.png"
    if png.exists():
        shutil.copy(png, args.out.with_name(f"{args.out.stem}_live_tau.png"))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("cycle_seconds", "live_heldout_before", "live_heldout_after")},
                     indent=2))


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


def wait_for_promotion(daemon: str, up: subprocess.Popen, log: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise RuntimeError(f"specloop up exited with {up.returncode}: {log.read_text()[-3000:]}")
        try:
            status = httpx.get(f"{daemon}/status", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            time.sleep(5)
            continue
        events = [e for e in status["history"] if e["action"] in ("promoted", "refused")]
        if events:
            event = events[-1]
            run = next(r for r in status["last_runs"] if r["version"] == event["version"].removeprefix("v"))
            if event["action"] == "refused":
                raise RuntimeError(f"the gate refused the challenger: {event['reason']}")
            cycle = datetime.fromisoformat(event["at"]) - datetime.fromisoformat(run["started_at"])
            return {"event": event, "run": run, "cycle_seconds": round(cycle.total_seconds(), 1)}
        time.sleep(5)
    raise TimeoutError(f"no promotion within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


def wait_serving(url: str, version: str, timeout_s: float) -> None:
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


def replayed(data: Path, heldout: list, version: str) -> dict:
    """The target's greedy answers to the held-out prompts, replayed with every proposer."""
    import torch

    from specloop.daemon.evaluation.replay import compare
    from specloop.daemon.shipped_drafters import shipped_drafters
    from specloop.engine.loaders.load import load_for_inference, resolve_device
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams
    from specloop.engine.speculation.drafter_artifact import max_artifact_bytes
    from specloop.storage.registry import DrafterRegistry
    from specloop.storage.sequences import TokenSequence

    loaded = load_for_inference(None, torch.bfloat16, resolve_device(None))
    tok = loaded.tokenizer
    ids = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in heldout]
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=8, max_len=2048), tok.eos_token_ids)
    out = engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    sequences = [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in out]
    registry = DrafterRegistry(f"sqlite:///{(data / 'registry' / 'mlflow.db').resolve()}", data / "registry" /
                               "artifacts")
    promoted = registry.download(registry.version(loaded.fingerprint, version.removeprefix("v")), data / "bench",
                                 max_artifact_bytes(loaded.model.config))
    drafters = [shipped_drafters()[loaded.fingerprint], promoted]
    report = compare(loaded.model, loaded.fingerprint, sequences, drafters, ngram_block_size=4)
    names = {str(drafters[0]): "v1 (shipped)", str(promoted): f"{version} (retrained)"}
    return {"set": report["set"], "results": [
        {"name": _label(r, names), "kind": r["kind"], "tau": round(r["tau"], 3),
         "per_position_acceptance": [round(a, 3) for a in r["per_position_acceptance"]]}
        for r in report["results"]]}


def _label(result: dict, names: dict[str, str]) -> str:
    if result["kind"] in ("ngram", "suffix"):
        return result["name"]
    return names[result["drafter"]] + {"combined": " + n-gram", "dflash+suffix": " + suffix"}.get(result["kind"], "")


if __name__ == "__main__":
    main()

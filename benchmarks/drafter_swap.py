"""What a live drafter swap costs clients: inter-token latency in steady state and around a swap.

One `specloop serve --registry` process (the real SmolLM2, bf16, combined proposer) follows the
`champion` alias of an MLflow registry (SQLite, local artifacts) holding two versions of the
drafter (`--drafter`, registered twice: the swap path is the same whatever the weights). Eight
clients stream chat completions back to back. After `--steady-s` seconds the alias moves from v1 to
v2 and the admin endpoint asks the engine to look now; the run goes on for `--after-s` seconds.

Reported, from client-side token arrival times: inter-token latency p50/p99 in steady state (before
the alias moved) and in the swap window (from the alias move to 2 s after the reload answered);
the largest gap in each; the engine-thread time of the swap as the server measured it
(`specloop_drafter_swap_pause_seconds`); and the median engine step in steady state (seconds per
`specloop_engine_steps` increment), the unit the target is stated in: a swap should pause decoding
for at most one step. Every request must finish without error and at its full length.

Writes `benchmarks/results/drafter_swap.json`. Run:
`.venv/bin/python benchmarks/drafter_swap.py --drafter daemon/drafters/SmolLM2-135M-Instruct`
(about a minute and a half). This is not a test.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.server_process import server_process  # noqa: E402
from specloop.engine.speculation.drafter_artifact import read_meta  # noqa: E402
from specloop.storage.registry import CHAMPION, DrafterRegistry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "drafter_swap.json"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three uses of copper.", "How do I reverse a list in Python?", "Why is the sky blue?",
             "Give me a recipe for pancakes.", "What does a compiler do?"]
CONCURRENCY = 8
ADMIN_TOKEN = "bench-admin-token-0123456789abcdef"


class Client(threading.Thread):
    """Streams chat completions back to back; keeps every token's arrival time."""

    def __init__(self, url: str, question: str, max_tokens: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.question, self.max_tokens, self.stop = url, question, max_tokens, stop
        self.gaps: list[tuple[float, float]] = []  # (arrival time, gap since the previous token)
        self.requests, self.failures = 0, []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self._one()
                self.requests += 1
            except Exception as e:  # counted and reported: every request must succeed
                self.failures.append(repr(e))

    def _one(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": self.question}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        last, finish = None, None
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                finish = chunk["choices"][0]["finish_reason"] or finish
                now = time.monotonic()
                if last is not None and chunk["choices"][0]["delta"].get("content"):
                    self.gaps.append((now, now - last))
                last = now
        assert finish == "length", finish


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def serving_version(url: str) -> str | None:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"]


def percentiles(gaps: list[float]) -> dict[str, float]:
    ms = sorted(g * 1e3 for g in gaps)
    return {"tokens": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2), "max_ms": round(ms[-1], 2)}


def run(args: argparse.Namespace, registry_dir: Path) -> dict:
    fingerprint = read_meta(args.drafter)["base_model_fingerprint"]
    registry = DrafterRegistry(f"sqlite:///{registry_dir / 'mlflow.db'}", registry_dir / "artifacts")
    v1, v2 = (registry.register(args.drafter, fingerprint) for _ in range(2))
    registry.set_alias(fingerprint, CHAMPION, v1.version)
    env = {"SPECLOOP_ADMIN_TOKEN": ADMIN_TOKEN, "SPECLOOP_HMAC_KEY": ADMIN_TOKEN[::-1],
           "SPECLOOP_DATA_DIR": str(registry_dir / "data")}
    options = ["--weights", "dense", "--registry", registry.tracking_uri, "--proposer", "combined",
               "--registry-poll-s", "3600",
               "--num-slots", str(CONCURRENCY)]
    with server_process(options, registry_dir / "serve.log", env) as server:
        deadline = time.monotonic() + 120
        while serving_version(server.url) != v1.label:
            assert time.monotonic() < deadline, "v1 never served"
            time.sleep(0.2)
        stop = threading.Event()
        clients = [Client(server.url, q, args.max_tokens, stop) for q in QUESTIONS[:CONCURRENCY]]
        for c in clients:
            c.start()
        time.sleep(args.warmup_s)
        steady_from, steps_from = time.monotonic(), metric(server.url, "specloop_engine_steps_total")
        time.sleep(args.steady_s)
        moved_at, steps_to = time.monotonic(), metric(server.url, "specloop_engine_steps_total")
        registry.set_alias(fingerprint, CHAMPION, v2.version)
        reload = httpx.post(f"{server.url}/admin/drafter/reload", timeout=120,
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
        answered_at = time.monotonic()
        time.sleep(args.after_s)
        stop.set()
        for c in clients:
            c.join(120)
        pause_s = metric(server.url, "specloop_drafter_swap_pause_seconds")
        served_after = serving_version(server.url)
    gaps = [g for c in clients for g in c.gaps]
    step_s = (moved_at - steady_from) / max(1.0, steps_to - steps_from)
    window = (moved_at, answered_at + 2.0)
    return {
        "benchmark": "drafter_swap", "machine": describe(), "model": "SmolLM2-135M-Instruct", "dtype": "bfloat16",
        "proposer": "combined", "concurrency": CONCURRENCY, "max_tokens": args.max_tokens,
        "drafter": str(args.drafter), "reload": reload, "served_after": served_after,
        "requests": sum(c.requests for c in clients), "failures": [f for c in clients for f in c.failures],
        "steady": percentiles([g for t, g in gaps if steady_from <= t < moved_at]),
        "swap_window": percentiles([g for t, g in gaps if window[0] <= t < window[1]]),
        "swap_window_s": round(window[1] - window[0], 2),
        "reload_answered_after_s": round(answered_at - moved_at, 3),
        "swap_pause_engine_thread_ms": round(pause_s * 1e3, 2),
        "steady_engine_step_ms": round(step_s * 1e3, 2),
        "swap_pause_in_steps": round(pause_s / step_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", type=Path, required=True, help="a drafter artifact for SmolLM2")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--warmup-s", type=float, default=10)
    parser.add_argument("--steady-s", type=float, default=30)
    parser.add_argument("--after-s", type=float, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = run(args, Path(tmp))
    text = json.dumps(report, indent=2)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

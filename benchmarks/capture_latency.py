"""Request latency with trace capture on vs off, side by side: what consent-gated capture costs a client.

Two `specloop serve` processes serve the same model with the same tenants file and API key; one
has capture on (`--kafka-bootstrap` pointed at a real tansu broker, every request from a subject
with active consent, so every request takes the whole path: consent lookup, PII scan, trace build,
Kafka send), the other has it off; a third, also off ("control"), measures what two identical
servers differ by on this machine, the noise floor any on/off figure must be read against. One
HTTP client sends the same chat prompts, one request at a time, in short rounds whose arm order
rotates, so load from other processes on a shared machine falls on all arms alike. Reported per
arm: p50 and p99 of client-side latency over all rounds, the
median over rounds of the per-round p50 ratio, and each server's CPU time per request (read from
/proc): on a shared machine latency moves by more than capture costs, CPU time much less. The sink is
not run: it is not on the request path and in production runs elsewhere.

Afterwards the capture arm's /metrics must show every measured request captured and sent, so the
"on" numbers are known to include the work. Writes `benchmarks/results/capture_latency.json`.
Run: `.venv/bin/python benchmarks/capture_latency.py [--smollm2]`. Target: capture adds < 2% to p50.

This is not a test: it asserts only that capture happened, and takes a minute or more.
"""

import argparse
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from storage.broker import EmbeddedBroker, ensure_topics, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` is not an installed package
from tests.engine.conftest import write_tiny_hf_model  # noqa: E402
from tests.integration.conftest import wait_ready  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "capture_latency.json"
KEY = "bench-key-0123456789abcdef"
TENANTS = f"""
tenants:
  - name: bench
    api_keys: ["{KEY}"]
    capture_allowed: true
    policy_version: "bench-1"
"""
PROMPTS = [  # ordinary requests without PII, so every one is captured
    "Suggest a name for a small bakery.",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "Give two tips for better sleep.",
    "Describe a rainbow to a child.",
    "What is 17 times 23?",
    "Name a famous bridge in San Francisco.",
    "Write one sentence about autumn leaves.",
]
_READY_S = 180


@dataclass(frozen=True)
class Arm:
    p50_ms: float
    p99_ms: float
    mean_ms: float
    requests: int
    server_cpu_ms_per_request: float  # the server process's CPU time (all threads) over the measured rounds


@dataclass(frozen=True)
class Row:
    model: str
    max_tokens: int
    rounds: int
    requests_per_round: int
    off: Arm
    on: Arm
    control: Arm  # a second capture-off server
    p50_overhead_pct: float  # pooled p50, on vs off
    control_p50_diff_pct: float  # pooled p50, control vs off: the noise floor
    p50_overhead_pct_median_of_rounds: float
    p99_overhead_pct: float
    cpu_overhead_pct: float  # server CPU per request, on vs off: the work capture adds, free of latency noise
    captured: float  # from the capture arm's /metrics
    sent: float


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far, all threads (from /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server(model: list[str], data_dir: Path, log: Path, kafka: str | None) -> Iterator[Server]:
    """A `specloop serve` process, yielded once ready; SIGTERMed on exit."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "specloop"), "serve", "--port", str(port), "--log-level", "warning"]
    command += model
    command += ["--kafka-bootstrap", kafka] if kafka else []
    env = {**os.environ, "SPECLOOP_DATA_DIR": str(data_dir), "SPECLOOP_TENANTS_FILE": str(data_dir / "tenants.yaml")}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, log, _READY_S)
            yield Server(url, process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


def _latencies(client: httpx.Client, url: str, model: str, user: str, max_tokens: int, count: int) -> list[float]:
    out = []
    for i in range(count):
        body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "user": user}
        started = time.perf_counter()
        r = client.post(f"{url}/v1/chat/completions", json=body)
        out.append(time.perf_counter() - started)
        r.raise_for_status()
    return out


def _arm(latencies: list[float], cpu_s: float) -> Arm:
    ms = sorted(x * 1000 for x in latencies)
    return Arm(p50_ms=statistics.median(ms), p99_ms=statistics.quantiles(ms, n=100)[98], mean_ms=statistics.fmean(ms),
               requests=len(ms), server_cpu_ms_per_request=1000 * cpu_s / len(ms))


def _metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def measure(model_options: list[str], bootstrap: str, work: Path, rounds: int, per_round: int, max_tokens: int) -> Row:
    with ExitStack() as stack:
        off = stack.enter_context(server(model_options, work, work / "off.log", None))
        control = stack.enter_context(server(model_options, work, work / "control.log", None))
        on = stack.enter_context(server(model_options, work, work / "on.log", bootstrap))
        client = stack.enter_context(httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=300))
        admin = json.loads((work / "consent-secrets.json").read_text())["admin_token"]
        r = client.post(f"{on.url}/admin/consents", json={"tenant": "bench", "user": "bench-user"},
                        headers={"Authorization": f"Bearer {admin}"})
        r.raise_for_status()
        model = client.get(f"{off.url}/v1/models").json()["data"][0]["id"]
        servers = {"off": off, "on": on, "control": control}
        for s in servers.values():  # warm-up: first requests, the producer's connection to Kafka
            _latencies(client, s.url, model, "bench-user", max_tokens, 4)
        warm_captured = _metric(on.url, 'specloop_capture_decisions_total{reason="captured"}')
        cpu_before = {arm: s.cpu_s() for arm, s in servers.items()}
        samples: dict[str, list[list[float]]] = {arm: [] for arm in servers}
        orders = list(itertools.permutations(servers))
        for i in range(rounds):
            for arm in orders[i % len(orders)]:
                samples[arm].append(_latencies(client, servers[arm].url, model, "bench-user", max_tokens, per_round))
            print(f"round {i + 1}/{rounds}: p50 off {statistics.median(samples['off'][-1]) * 1000:.1f} ms, "
                  f"on {statistics.median(samples['on'][-1]) * 1000:.1f} ms, "
                  f"control {statistics.median(samples['control'][-1]) * 1000:.1f} ms", flush=True)
        time.sleep(2)  # let the last traces reach the broker before reading the counters
        cpu = {arm: s.cpu_s() - cpu_before[arm] for arm, s in servers.items()}
        captured = _metric(on.url, 'specloop_capture_decisions_total{reason="captured"}') - warm_captured
        sent = _metric(on.url, "specloop_traces_sent_total")
    pooled = {arm: _arm([x for r in rounds_ for x in r], cpu[arm]) for arm, rounds_ in samples.items()}
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(samples["on"], samples["off"])]
    return Row(model=model, max_tokens=max_tokens, rounds=rounds, requests_per_round=per_round, off=pooled["off"],
               on=pooled["on"], control=pooled["control"],
               p50_overhead_pct=100 * (pooled["on"].p50_ms / pooled["off"].p50_ms - 1),
               control_p50_diff_pct=100 * (pooled["control"].p50_ms / pooled["off"].p50_ms - 1),
               p50_overhead_pct_median_of_rounds=100 * (statistics.median(ratios) - 1),
               p99_overhead_pct=100 * (pooled["on"].p99_ms / pooled["off"].p99_ms - 1),
               cpu_overhead_pct=100 * (pooled["on"].server_cpu_ms_per_request
                                       / pooled["off"].server_cpu_ms_per_request - 1),
               captured=captured, sent=sent)


def _tiny_model(directory: Path) -> list[str]:
    """The test suite's tiny random Llama (real files, real tokenizer), written to `directory`."""
    # 256 = the tiny model's max_position_embeddings
    return ["--model", str(write_tiny_hf_model(directory, "llama")), "--max-len", "256", "--dtype", "float32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Short rounds follow the machine's load closely; every request but a round's first still meets the
    # capture work of the request before it, as in a steady stream of captured traffic.
    parser.add_argument("--rounds", type=int, default=36)
    parser.add_argument("--per-round", type=int, default=8)
    parser.add_argument("--smollm2", action="store_true", help="also measure SmolLM2-135M (slower)")
    parser.add_argument("--smollm2-rounds", type=int, default=12)
    parser.add_argument("--smollm2-per-round", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        work = Path(tmp)
        (work / "tenants.yaml").write_text(TENANTS)
        ensure_topics(broker.bootstrap_servers, {"traces": 3})
        rows.append(measure(_tiny_model(work / "tiny"), broker.bootstrap_servers, work, args.rounds, args.per_round,
                            args.max_tokens))
        if args.smollm2:
            rows.append(measure([], broker.bootstrap_servers, work, args.smollm2_rounds, args.smollm2_per_round,
                                args.max_tokens))
    for row in rows:
        assert row.captured == row.on.requests and row.sent >= row.captured, row
    result = {"cpu": platform.machine(), "cores": os.cpu_count(),
              "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
              "target": "capture adds < 2% to p50", "rows": [asdict(r) for r in rows]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| model | p50 ms off / on / control | p50 on vs off (pooled / median of rounds) | control vs off "
          "| p99 ms off / on | server CPU ms/request off / on / control |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.model} | {r.off.p50_ms:.1f} / {r.on.p50_ms:.1f} / {r.control.p50_ms:.1f} "
              f"| {r.p50_overhead_pct:+.2f}% / {r.p50_overhead_pct_median_of_rounds:+.2f}% "
              f"| {r.control_p50_diff_pct:+.2f}% | {r.off.p99_ms:.1f} / {r.on.p99_ms:.1f} "
              f"| {r.off.server_cpu_ms_per_request:.2f} / {r.on.server_cpu_ms_per_request:.2f} / "
              f"{r.control.server_cpu_ms_per_request:.2f} |")


if __name__ == "__main__":
    main()

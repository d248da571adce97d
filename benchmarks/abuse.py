"""Well-behaved clients beside abusive ones: what the server's limits keep for the well-behaved.

One `specloop serve` process (the real SmolLM2, bf16, 8 KV-cache slots) and a tenants file with
four tenants: `good` and `abuser` (no limits of their own), `flood` (at most 2 sequences in flight)
and `slow` (at most 4). Eight `good` clients stream greedy chat completions back to back, first alone for
`--phase-s` seconds, then for as long again beside abusers, which run in a process of their own so
their Python work does not sit in the measuring clients' interpreter:

| abuser | what it sends | expected |
| --- | --- | --- |
| `gigabyte` | 2 connections at a time declaring 1 GiB bodies, no key, sending the first MiB | 401 |
| `stop_strings` | 100,000 stop strings (a ~700 kB body) | 400 |
| `n16` | `n: 16`, `ignore_eos`, no `max_tokens` | 400 |
| `schema` | a 10 MB JSON schema | 413 |
| `flood` | up to 10,000 requests, 16 at a time, from the `flood` tenant | 429 and some 200 |
| `slow_reader` | 2 streams at a time (`n: 2`, `slow` tenant) whose client reads nothing | ended by the server |

The abusers' process runs at a lower CPU priority and the measuring clients' at a higher one
(`ABUSER_NICE`, `CLIENT_NICE`): here all three share the server's 2 cores, where an attacker's
machine costs the server nothing. Reported: the good clients' inter-chunk latency p50 and p99 in
each phase and their ratio (target ≤ 1.5x), their time to first token (which grows: the other
tenants' fair share of the slots), their 5xx and failed requests (target 0), the slowest `/health`
answer (polled every 200 ms; target < 1 s), the server's peak RSS and CPU time, its own count of
token gaps, and every abuser's status counts.

Writes `benchmarks/results/abuse.json`. Run: `.venv/bin/python benchmarks/abuse.py` (about 3
minutes with the defaults). This is not a test.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from benchmarks.server_process import Server, server_process  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "abuse.json"
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"good": "good-tenant-key-0123456789", "abuser": "abuser-tenant-key-0123456789",
        "flood": "flood-tenant-key-0123456789", "slow": "slow-tenant-key-0123456789"}
TENANTS = f"""allow_anonymous: false
tenants:
  - name: good
    api_keys: ["{KEYS['good']}"]
  - name: abuser
    api_keys: ["{KEYS['abuser']}"]
  - name: flood
    api_keys: ["{KEYS['flood']}"]
    limits: {{max_concurrent_sequences: 2}}
  - name: slow
    api_keys: ["{KEYS['slow']}"]
    limits: {{max_concurrent_sequences: 4}}
"""
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List three uses of copper.", "How do I reverse a list in Python?", "Why is the sky blue?",
             "Give me a recipe for pancakes.", "What does a compiler do?"]
GOOD_CLIENTS = 8
FLOOD_REQUESTS, FLOOD_CONCURRENCY = 10_000, 16
_MEGABYTE = b"x" * (1 << 20)
# The abusers share these 2 cores with the server and the measured clients, where a real attacker's
# load generator costs the server nothing: at the default priority their process took a third of
# the CPU (37.5 of 120 CPU-seconds in a 60 s phase) and starved the measuring clients' own process.
# Lower priority keeps the comparison about the server; the achieved request counts are reported.
ABUSER_NICE = 10
CLIENT_NICE = -5  # the measuring clients' process, so that their own scheduling is not what is measured


class GoodClient(threading.Thread):
    """Streams chat completions back to back; keeps the gap before every content chunk."""

    def __init__(self, url: str, question: str, max_tokens: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.question, self.max_tokens, self.stop = url, question, max_tokens, stop
        self.gaps: list[float] = []
        self.first_token_s: list[float] = []
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEYS['good']}"}) as client:
            while not self.stop.is_set():
                try:
                    self._one(client)
                except Exception as e:  # counted and reported: every request must succeed
                    self.failures.append(repr(e))

    def _one(self, client: httpx.Client) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.question}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        last, started = None, time.monotonic()
        with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
            self.statuses[r.status_code] += 1
            if r.status_code != 200:
                r.read()
                return
            for line in r.iter_lines():
                # Content chunks only: the first chunk (the role, empty content) is sent before the request
                # holds a slot, so the wait for one is time to first token, not a gap in the stream.
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append(now - last)
                    else:
                        self.first_token_s.append(now - started)
                    last = now


class Watch(threading.Thread):
    """`/health` answer times and the server's resident memory, sampled until stopped."""

    def __init__(self, url: str, pid: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.pid, self.stop = url, pid, stop
        self.health_s: list[float] = []
        self.health_failures = 0
        self.rss_mb: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            started = time.monotonic()
            try:
                ok = httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.health_s.append(time.monotonic() - started)
            self.health_failures += not ok
            status = Path(f"/proc/{self.pid}/status").read_text()
            self.rss_mb.append(int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) / 1024)


# ------------------------------------------------------------------------------------------------ abusers


async def _loop(until: float, statuses: Counter, send) -> None:  # noqa: ANN001 - a coroutine factory
    while time.monotonic() < until:
        try:
            statuses[await asyncio.wait_for(send(), until - time.monotonic() + 30)] += 1
        except (httpx.HTTPError, OSError, TimeoutError) as e:
            statuses[type(e).__name__] += 1


async def _gigabyte(url: str) -> int:
    """Declare a 1 GiB body with no key, send its first MiB, and read the answer."""
    host = urlparse(url)
    reader, writer = await asyncio.open_connection(host.hostname, host.port)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {1 << 30}\r\n\r\n".encode() + _MEGABYTE)
        answer = await reader.readline()
        return int(answer.split()[1])
    finally:
        writer.close()


async def _slow_reader(url: str, body: bytes, until: float) -> int:
    """A stream whose client reads nothing after its status line, until the phase ends (the server's
    `slow_reader` count says whether it ended the stream first)."""
    host = urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host.hostname, host.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {KEYS['slow']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        return status
    finally:
        writer.close()


async def _abuse(url: str, seconds: float) -> dict[str, dict]:
    until = time.monotonic() + seconds
    found: dict[str, Counter] = {name: Counter() for name in
                                 ("gigabyte", "stop_strings", "n16", "schema", "flood", "slow_reader")}
    auth = {"Authorization": f"Bearer {KEYS['abuser']}"}
    stop_body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "stop": [f"s{i}" for i in range(100_000)]}).encode()
    n16_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 16, "ignore_eos": True}
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                               for i in range(90_000)}}
    schema_body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "s", "schema": schema}}}).encode()
    slow_body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                            "stream": True, "n": 2, "max_tokens": 512, "ignore_eos": True}).encode()
    flood_left = [FLOOD_REQUESTS]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=FLOOD_CONCURRENCY + 16)) as c:
        async def post(content: bytes | None = None, body: dict | None = None, headers: dict = auth) -> int:
            r = await c.post(f"{url}/v1/chat/completions", content=content, json=body,
                             headers={**headers, "Content-Type": "application/json"})
            return r.status_code

        async def flood() -> int:
            if not flood_left[0]:
                await asyncio.sleep(0.1)
                return 0
            flood_left[0] -= 1
            return await post(body={"model": MODEL, "messages": [{"role": "user", "content": "flood"}],
                                    "max_tokens": 16}, headers={"Authorization": f"Bearer {KEYS['flood']}"})

        tasks = [_loop(until, found["gigabyte"], lambda: _gigabyte(url)) for _ in range(2)]
        tasks += [_loop(until, found["stop_strings"], lambda: post(content=stop_body)),
                  _loop(until, found["n16"], lambda: post(body=n16_body)),
                  _loop(until, found["schema"], lambda: post(content=schema_body))]
        tasks += [_loop(until, found["flood"], flood) for _ in range(FLOOD_CONCURRENCY)]
        tasks += [_loop(until, found["slow_reader"], lambda: _slow_reader(url, slow_body, until)) for _ in range(2)]
        await asyncio.gather(*tasks)
    found["flood"].pop(0, None)
    return {name: {str(k): v for k, v in sorted(counts.items(), key=str)} for name, counts in found.items()}


def _abuser_process(url: str, seconds: float, out: "multiprocessing.Queue") -> None:
    os.nice(ABUSER_NICE - os.nice(0))  # forked from the clients' process: to the absolute level
    found = asyncio.run(_abuse(url, seconds))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put({"cpu_s": round(usage.ru_utime + usage.ru_stime, 1), **found})


# -------------------------------------------------------------------------------------------------- phases


def _samples(url: str, name: str, label: str) -> dict[str, float]:
    """One metric's samples from the server's `/metrics`, by the value of `label`."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels[label]: s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in f.samples if s.name == name}


def _itl_over(url: str) -> dict[str, float]:
    """The server's own inter-token latency histogram (every stream's): how many gaps over each bound."""
    buckets = _samples(url, "specloop_inter_token_latency_seconds_bucket", "le")
    total = buckets["+Inf"]
    return {bound: total - count for bound, count in buckets.items() if bound in ("0.1", "0.3", "1.0")}


def _phase(server: Server, seconds: float, max_tokens: int, abusers: bool) -> dict:
    url, pid, server_cpu_s, itl_before = server.url, server.pid, server.cpu_s(), _itl_over(server.url)
    stop = threading.Event()
    clients = [GoodClient(url, QUESTIONS[i % len(QUESTIONS)], max_tokens, stop) for i in range(GOOD_CLIENTS)]
    watch = Watch(url, pid, stop)
    results, process = multiprocessing.Queue(), None
    if abusers:
        process = multiprocessing.Process(target=_abuser_process, args=(url, seconds, results))
        process.start()
    for thread in (*clients, watch):
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in (*clients, watch):
        thread.join(timeout=180)
    abuse = None
    if process is not None:
        abuse = results.get(timeout=300)
        process.join(timeout=60)
    limited, server_cpu_s = _samples(url, "specloop_limited_requests_total", "reason"), server.cpu_s() - server_cpu_s
    itl_over = {f"over_{bound}_s": n - itl_before[bound] for bound, n in _itl_over(url).items()}
    gaps = sorted(g for c in clients for g in c.gaps)
    firsts = sorted(f for c in clients for f in c.first_token_s)
    statuses = sum((c.statuses for c in clients), Counter())
    return {
        "seconds": seconds, "chunks": len(gaps),
        "inter_chunk_p50_ms": round(1e3 * statistics.median(gaps), 2),
        "inter_chunk_p99_ms": round(1e3 * gaps[int(0.99 * (len(gaps) - 1))], 2),
        "first_token_p50_s": round(statistics.median(firsts), 3),
        "first_token_p99_s": round(firsts[int(0.99 * (len(firsts) - 1))], 3),
        "good_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "good_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "good_failures": [f for c in clients for f in c.failures][:10],
        "health_max_s": round(max(watch.health_s), 3), "health_failures": watch.health_failures,
        "server_rss_peak_mb": round(max(watch.rss_mb), 1), "server_cpu_s": round(server_cpu_s, 1),
        "server_side_token_gaps": itl_over,
        "abusers": abuse,
        "server_limited_so_far": limited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=15.0, help="good clients alone, not measured")
    parser.add_argument("--max-tokens", type=int, default=64, help="each good request's length")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(TENANTS)
        env = {"SPECLOOP_TENANTS_FILE": str(tenants), "SPECLOOP_DATA_DIR": tmp}
        with server_process(["--weights", "dense", "--num-slots", "8"], Path(tmp) / "server.log", env) as server:
            os.nice(CLIENT_NICE)  # after the server started: it keeps the default priority
            _phase(server, args.warmup_s, args.max_tokens, abusers=False)  # every batch shape once
            alone = _phase(server, args.phase_s, args.max_tokens, abusers=False)
            print(json.dumps({"alone": alone}, indent=1), flush=True)
            beside = _phase(server, args.phase_s, args.max_tokens, abusers=True)
    report = {
        "machine": describe(), "good_clients": GOOD_CLIENTS, "max_tokens": args.max_tokens, "num_slots": 8,
        "alone": alone, "with_abusers": beside,
        "p50_ratio": round(beside["inter_chunk_p50_ms"] / alone["inter_chunk_p50_ms"], 3),
        "p99_ratio": round(beside["inter_chunk_p99_ms"] / alone["inter_chunk_p99_ms"], 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("p50_ratio", "p99_ratio")} | {"with_abusers": beside}, indent=1))


if __name__ == "__main__":
    main()

"""Cost of one `CapturePolicy.decide` call, per outcome, measured side by side in one run.

The engine calls `decide` for every finished request, so its cost is added to request latency when
capture is on. Cases: a tenant that disallows capture (no lookup), a user without consent (two
indexed lookups), a consented user with clean text (lookup + PII scan), and one whose text holds
an email (dropped). Text sizes are those of a typical chat turn (about 2 KB of prompt and 2 KB of
response) and of a long one (16 KB each). Writes JSON to benchmarks/results/capture_decision.json.

Usage: python benchmarks/capture_decision.py [--n 2000]
"""

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry

from specloop.consent.capture import CapturePolicy
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.consent.tenants import TenantDirectory, TenantPolicy

WORDS = ("the model drafts a block of tokens and the target verifies them in one pass so that "
         "accepted tokens cost a fraction of a decode step while rejected ones cost nothing more "
         "def forward(self, x): return self.proj(x) + 1 for i in range(10): print(i)").split()


def text(chars: int, rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def time_per_call(policy: CapturePolicy, args: tuple, n: int) -> dict[str, float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter_ns()
        policy.decide(*args)
        samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    return {"p50_us": round(samples[n // 2], 1), "p99_us": round(samples[int(n * 0.99)], 1),
            "mean_us": round(statistics.fmean(samples), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    n = parser.parse_args().n
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        registry = ConsentRegistry(Path(tmp) / "consent.db")
        pseudonymizer = Pseudonymizer(b"benchmark-key-not-a-secret-0123456789")
        for i in range(10_000):  # a registry with realistic size, not an empty table
            registry.grant("acme", pseudonymizer.subject("acme", f"user-{i}"), "drafter_training",
                           "v1", "bench")
        tenants = TenantDirectory(
            [TenantPolicy(name="acme", capture_allowed=True, policy_version="v1"),
             TenantPolicy(name="closed")], allow_anonymous=False)
        policy = CapturePolicy(registry, tenants, pseudonymizer, "drop", CollectorRegistry())
        now = datetime.now(UTC)
        results = {}
        for size in (2_000, 16_000):
            prompt, response = text(size, rng), text(size, rng)
            cases = {
                "tenant_disallows": ("closed", "user-1", prompt, response, now),
                "no_consent": ("acme", "stranger", prompt, response, now),
                "captured": ("acme", "user-1", prompt, response, now),
                "pii_dropped": ("acme", "user-1", prompt, response + " mail a@example.com", now),
            }
            for name, args in cases.items():
                assert policy.decide(*args).reason == name, name
                results[f"{name}@{size}B"] = time_per_call(policy, args, n)
        registry.close()
    report = {"benchmark": "capture_decision", "n": n, "machine": platform.processor() or
              platform.machine(), "python": platform.python_version(), "results": results}
    out = Path(__file__).parent / "results" / "capture_decision.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:28s} p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us")


if __name__ == "__main__":
    main()

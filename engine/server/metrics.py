"""Prometheus metrics for the server, on a registry of its own (so tests and apps never collide).

Request counters and latency histograms are updated by the API as requests finish; engine load
(queue depth, running sequences, KV-cache use, steps) is read from `engine.stats()` at scrape
time, so it is never stale. Speculation counters have vLLM's meaning (docs/architecture.md,
"Acceptance numbers"): drafts, draft tokens, accepted tokens, and accepted tokens per draft position.

This file does not time anything itself; callers pass durations and counts in.
"""

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specloop.engine.runtime.llm_engine import EngineStats
from specloop.engine.runtime.sequence import SpecStats

# Seconds; CPU decode of SmolLM2 runs at tens of ms per token, a GPU at a few ms.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _version_label(version: str | None) -> str:
    return version or "none"


class _EngineLoadCollector(Collector):
    """Gauges read from the engine when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield GaugeMetricFamily("specloop_num_requests_waiting", "Requests waiting for a KV-cache slot.", s.waiting)
        yield GaugeMetricFamily("specloop_num_requests_running", "Sequences in the running batch.", s.running)
        yield GaugeMetricFamily("specloop_kv_cache_slots_used", "KV-cache slots held by sequences.", s.slots_used)
        yield GaugeMetricFamily("specloop_kv_cache_slots_total", "KV-cache slots in all.", s.slots_total)
        yield GaugeMetricFamily("specloop_kv_cache_tokens_used", "Tokens whose K/V are cached.", s.kv_tokens_used)
        yield GaugeMetricFamily("specloop_kv_cache_tokens_total", "Token capacity of the KV cache.", s.kv_tokens_total)
        usage = s.kv_tokens_used / s.kv_tokens_total if s.kv_tokens_total else 0.0
        yield GaugeMetricFamily("specloop_kv_cache_usage_ratio", "Fraction of KV-cache tokens in use.", usage)
        yield CounterMetricFamily("specloop_engine_steps", "Engine forward steps run.", s.steps)
        yield GaugeMetricFamily("specloop_drafters_live", "Drafters serving sequences (2 for a while after a swap).",
                                s.drafters_live)
        yield GaugeMetricFamily("specloop_drafter_swap_pause_seconds",
                                "Engine-thread time of the last drafter swap, build and probe included.",
                                s.last_swap_pause_s)
        serving = GaugeMetricFamily("specloop_drafter_serving", "1 for the drafter version new requests get.",
                                    labels=["drafter_version"])
        serving.add_metric([_version_label(s.drafter_version)], 1)
        yield serving


class ServerMetrics:
    """Every metric the server exports. Methods are thread-safe (prometheus-client locks)."""

    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specloop_requests", "Requests by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("specloop_time_to_first_token_seconds", "Arrival to first streamed token.",
                              ["endpoint"], buckets=_REQUEST_BUCKETS, registry=r)
        self.e2e = Histogram("specloop_e2e_request_latency_seconds", "Arrival to last token.",
                             ["endpoint"], buckets=_REQUEST_BUCKETS, registry=r)
        self.itl = Histogram("specloop_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specloop_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("specloop_generation_tokens", "Tokens generated.", registry=r)
        # Speculation counters by the drafter version that drafted, so live τ of a new champion and of
        # the one before it can be compared after a swap ("none": n-gram lookup, no learned drafter).
        self.spec_drafts = Counter("specloop_spec_decode_num_drafts", "Verify steps that carried drafts.",
                                   ["drafter_version"], registry=r)
        self.spec_draft_tokens = Counter("specloop_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                         ["drafter_version"], registry=r)
        self.spec_accepted = Counter("specloop_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                     ["drafter_version"], registry=r)
        self.spec_accepted_per_pos = Counter("specloop_spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.",
                                             ["drafter_version", "position"], registry=r)
        self.drafter_swaps = Counter("specloop_drafter_swaps", "Drafter swaps tried, by result and refusal reason.",
                                     ["result", "reason"], registry=r)
        self.canary = Gauge("specloop_drafter_canary_tau", "τ of each drafter version on the canary probes right "
                            "after it was swapped in, and whether it passed (engine/speculation/canary.py).",
                            ["drafter_version", "result"], registry=r)
        self.limited = Counter("specloop_limited_requests", "Requests refused or ended by a limit, by reason "
                               "(engine/server/admission.py, edge.py).", ["reason"], registry=r)
        self.hook_errors = Counter("specloop_finish_hook_errors", "Finished-request hook calls that raised.",
                                   registry=r)
        r.register(_EngineLoadCollector(engine_stats))

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_first_token(self, endpoint: str, seconds: float) -> None:
        self.ttft.labels(endpoint=endpoint).observe(seconds)

    def record_tokens(self, gap_seconds: float, num_tokens: int) -> None:
        """One engine delta of `num_tokens` arriving `gap_seconds` after the previous one."""
        for _ in range(num_tokens):
            self.itl.observe(gap_seconds / num_tokens)

    def record_finished(self, endpoint: str, seconds: float, prompt_tokens: int, completion_tokens: int,
                        spec: SpecStats | None, drafter_version: str | None = None) -> None:
        self.e2e.labels(endpoint=endpoint).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if spec is None or not spec.drafts:
            return
        version = _version_label(drafter_version)
        self.spec_drafts.labels(version).inc(spec.drafts)
        self.spec_draft_tokens.labels(version).inc(spec.draft_tokens)
        self.spec_accepted.labels(version).inc(spec.accepted_tokens)
        for pos, accepted in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_pos.labels(drafter_version=version, position=str(pos)).inc(accepted)

    def record_swap(self, result: str, reason: str | None) -> None:
        """One drafter swap tried: `ok`, or `refused` with its reason (engine/server/drafter_follower.py)."""
        self.drafter_swaps.labels(result=result, reason=reason or "").inc()

    def record_canary(self, version: str, tau: float, passed: bool) -> None:
        self.canary.labels(drafter_version=version, result="pass" if passed else "fail").set(tau)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The engine's capture hook screens what it stores, the token ids, and strips ids in strip mode.

A real `CapturePolicy` over a real consent registry; the Kafka producer is replaced by a list (the
producer has its own tests, and the capture pipeline runs through the real broker in
tests/integration/test_capture_pipeline.py)."""

from datetime import timedelta

import pytest
from prometheus_client import CollectorRegistry

from specloop.consent.capture import CapturePolicy
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.redaction import PLACEHOLDER
from specloop.consent.registry import ConsentRegistry
from specloop.consent.tenants import TenantDirectory
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.server.serving import FinishedRequest
from specloop.engine.server.trace_hook import TraceCapture
from tests.consent.test_capture import NOW, grant
from tests.consent.test_redaction import CharTokens


class Submitted(list):
    def submit(self, trace: object) -> None:
        self.append(trace)

    def close(self, timeout: float) -> None:
        pass


def finished(tok: CharTokens, tenant: str, prompt: str, response: str, shown: str) -> FinishedRequest:
    """`shown`: the response text up to a stop string; `response`: every token generated."""
    at = (NOW - timedelta(seconds=1)).timestamp()
    return FinishedRequest("req-1", "completions", tenant, "u1", "m", "fp", tuple(tok.encode(prompt)),
                           tuple(tok.encode(response)), prompt, shown, SamplingParams(max_tokens=16), ("END",), None,
                           None, "stop", at, at, at)


@pytest.fixture
def hook(registry: ConsentRegistry, tenants: TenantDirectory, pseudonymizer: Pseudonymizer
         ) -> tuple[TraceCapture, Submitted, CharTokens, CollectorRegistry]:
    for tenant in ("acme", "globex"):  # acme drops traces with PII, globex strips them
        grant(registry, pseudonymizer, tenant, "u1")
    metrics, out, tok = CollectorRegistry(), Submitted(), CharTokens(3)
    policy = CapturePolicy(registry, tenants, pseudonymizer, "drop", metrics)
    capture = TraceCapture(policy, out, metrics, detokenize=tok.decode, tokenize=tok.encode)
    yield capture, out, tok, metrics  # each test closes it: close() examines what is queued, then stops


def nothing_stored(hook: tuple, tenant: str, prompt: str, response: str, shown: str) -> CollectorRegistry:
    """Capture one request and close; asserts no trace was submitted; the hook's metrics."""
    capture, out, tok, metrics = hook
    capture(finished(tok, tenant, prompt, response, shown=shown))
    capture.close(5)
    assert out == []
    return metrics


def test_tokens_past_a_stop_string_are_screened(hook: tuple) -> None:
    metrics = nothing_stored(hook, "acme", "hello", "fine END mail bob@example.org", shown="fine ")
    assert metrics.get_sample_value("specloop_capture_decisions_total", {"reason": "pii_dropped"}) == 1


def test_strip_mode_stores_no_ids_of_what_was_found(hook: tuple) -> None:
    capture, out, tok, _ = hook
    capture(finished(tok, "globex", "write to alice at example dot com now", "Sure, I will write.",
                           shown="Sure, I will write."))
    capture.close(5)
    [trace] = out
    assert tok.decode(trace.prompt_token_ids).count(PLACEHOLDER) == 1 and "alice" not in tok.decode(
        trace.prompt_token_ids)
    assert tok.decode(trace.response_token_ids) == "Sure, I will write."
    assert trace.prompt_text is None and trace.response_text is None


def test_strip_mode_drops_a_trace_with_nothing_left(hook: tuple) -> None:
    metrics = nothing_stored(hook, "globex", "my mail?", "bob@example.org", shown="bob@example.org")
    assert metrics.get_sample_value("specloop_capture_hook_dropped_total", {"reason": "stripped_to_nothing"}) == 1

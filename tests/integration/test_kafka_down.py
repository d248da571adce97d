"""Serving with capture on while the broker is unreachable: every response is a normal 200, and every
trace that could not be sent is counted as dropped, none silently lost."""

import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from specloop.engine.loaders.load import LoadedModel
from specloop.storage.broker import free_port
from tests.integration.conftest import ACME_KEY, TENANTS_YAML, consent_settings, server_settings, serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REQUESTS = 6
QUEUE = 2
# One KafkaProducer connect attempt blocks for its 2 s bootstrap timeout; a request anywhere near that
# long would mean serving waited for Kafka. A tiny-model request takes tens of milliseconds.
_BLOCKED_S = 2.0


def _sample(app: FastAPI, prefix: str) -> float:
    text = app.state.serving.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def _eventually(read: "callable", expected: float, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_requests_succeed_and_drops_are_counted_when_kafka_is_down(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    settings = server_settings(kafka_bootstrap=f"127.0.0.1:{free_port()}", capture_queue_size=QUEUE,
                               capture_flush_s=1)
    consent = consent_settings(tmp_path, TENANTS_YAML)
    admin = {"Authorization": f"Bearer {consent.resolve().admin_token}"}
    with serving(tiny_loaded, settings, consent) as (url, app):
        granted = httpx.post(f"{url}/admin/consents", json={"tenant": "acme", "user": "alice"}, headers=admin)
        assert granted.status_code == 201, granted.text
        body = {"model": tiny_loaded.name, "prompt": "hello", "max_tokens": 4, "user": "alice"}
        for _ in range(REQUESTS):
            started = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ACME_KEY}"})
            assert r.status_code == 200 and time.monotonic() - started < _BLOCKED_S, r.text
        assert _eventually(lambda: _sample(app, 'specloop_capture_decisions_total{reason="captured"}'),
                           REQUESTS) == REQUESTS
        # One trace is held by the connecting producer thread, QUEUE wait in its queue, the rest overflow.
        assert _sample(app, 'specloop_traces_dropped_total{reason="queue_full"}') >= REQUESTS - 1 - QUEUE
    assert _eventually(lambda: _sample(app, "specloop_traces_dropped_total{"), REQUESTS) == REQUESTS
    assert _sample(app, "specloop_traces_sent_total") == 0

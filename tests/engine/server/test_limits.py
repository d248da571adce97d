"""Every limit against a real uvicorn server: the documented status, the field it names, and nothing
done before it is checked (docs/api.md, "Limits")."""

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest

from specloop.consent.tenants import TenantDirectory, TenantLimits, TenantPolicy
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.engine.server.conftest import NUM_SLOTS, RunningServer, metric, serving

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Say hello."}]
KEYS = {"steady": "steady-key-0123456789abcdef", "capped": "capped-key-0123456789abcdef"}


def _post(server: RunningServer, body: dict, key: str | None = None, path: str = "/v1/chat/completions",
          timeout: float = 20) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=timeout)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def limited(tiny_loaded: LoadedModel) -> Iterator[RunningServer]:
    """Small limits, and two tenants: `steady` unlimited, `capped` held to limits of its own."""
    tenants = TenantDirectory([
        TenantPolicy(name="steady", api_keys=(KEYS["steady"],)),
        TenantPolicy(name="capped", api_keys=(KEYS["capped"],),
                     limits=TenantLimits(max_concurrent_sequences=2, requests_per_minute=600, tokens_per_minute=4000,
                                         max_request_tokens=64)),
    ], allow_anonymous=False)
    with serving(tiny_loaded, None, tenants, max_body_bytes=16 << 10, max_prompt_chars=2000, max_request_tokens=512,
                 max_schema_bytes=2048, max_schema_depth=6, max_waiting=2, queue_timeout_s=30) as running:
        yield running


def _body(server: RunningServer, **fields: object) -> dict:
    return {"model": server.model, "messages": HELLO, "max_tokens": 4, **fields}


# ------------------------------------------------------------------------------------- before the body


def _raw_exchange(server: RunningServer, head: str, body_part: bytes) -> tuple[bytes, float]:
    """Send a request head and part of its body on a raw socket; the server's whole answer and how long
    it took (the rest of the body is never sent)."""
    url = urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + body_part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - started


def test_an_unauthenticated_gigabyte_is_refused_from_its_headers(limited: RunningServer) -> None:
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n")
    answer, took = _raw_exchange(limited, head, b'{"model": "' + b"x" * 1000)
    assert answer.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in answer, answer[:300]
    assert took < 5


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(limited: RunningServer) -> None:
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEYS['steady']}\r\nContent-Length: {1 << 30}\r\n\r\n")
    answer, _ = _raw_exchange(limited, head, b"{")
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]


def test_a_chunked_body_over_the_limit_is_413(limited: RunningServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield json.dumps(_body(limited))[:-1].encode() + b', "user": "'
        for _ in range(40):
            yield b"u" * 1024
        yield b'"}'

    r = httpx.post(f"{limited.base_url}/v1/chat/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {KEYS['steady']}", "Content-Type": "application/json"})
    assert _error(r, 413)["code"] == "request_too_large"
    assert metric(limited, "specloop_limited_requests_total", reason="body_too_large") >= 2


# ---------------------------------------------------------------------------------------- the body's fields


@pytest.mark.parametrize("stop, message", [
    (["a"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
    (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
    ([str(i) for i in range(100_000)][:2000], f"at most {MAX_STOP_STRINGS} stop strings, got 2000"),
])
def test_stop_strings_are_bounded(limited: RunningServer, stop: list[str], message: str) -> None:
    err = _error(_post(limited, _body(limited, stop=stop), KEYS["steady"]), 400)
    assert err["param"] == "stop" and message in err["message"]


def test_a_prompt_over_its_characters_is_refused_before_it_is_tokenized(limited: RunningServer) -> None:
    messages = [{"role": "user", "content": "é" * 1500}, {"role": "user", "content": "x" * 501}]
    err = _error(_post(limited, _body(limited, messages=messages), KEYS["steady"]), 400)
    assert (err["param"], err["code"]) == ("messages", "context_length_exceeded")
    assert "2001 characters" in err["message"]
    body = {"model": limited.model, "prompt": "y" * 2001, "max_tokens": 1}
    err = _error(_post(limited, body, KEYS["steady"], path="/v1/completions"), 400)
    assert err["param"] == "prompt"


def test_n_times_max_tokens_is_bounded(limited: RunningServer) -> None:
    err = _error(_post(limited, _body(limited, n=16, max_tokens=33), KEYS["steady"]), 400)
    assert err["param"] == "max_tokens" and "16 × 33 = 528" in err["message"]
    # Without max_tokens a chat choice may fill the context: 16 of them are too many.
    body = {"model": limited.model, "messages": HELLO, "n": 16, "ignore_eos": True}
    assert _error(_post(limited, body, KEYS["steady"]), 400)["param"] == "max_tokens"
    # A tenant's own cap is lower than the server's.
    assert "at most 64" in _error(_post(limited, _body(limited, n=2, max_tokens=33), KEYS["capped"]), 400)["message"]


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "items": {"type": "string"}}}}}}}, "nests deeper than 6"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}, "bytes; this server takes"),
])
def test_schemas_are_bounded_in_depth_and_size(limited: RunningServer, schema: dict, message: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    err = _error(_post(limited, _body(limited, response_format=fmt), KEYS["steady"]), 400)
    assert err["param"] == "response_format" and message in err["message"]


# ------------------------------------------------------------------------------------------- admission


def test_a_full_queue_is_429_with_retry_after(limited: RunningServer, slow_decode: None) -> None:
    async def flood() -> list[httpx.Response]:
        body = _body(limited, ignore_eos=True, max_tokens=60)
        async with httpx.AsyncClient(timeout=60) as c:
            return list(await asyncio.gather(*(c.post(f"{limited.base_url}/v1/chat/completions", json=body,
                                                      headers={"Authorization": f"Bearer {KEYS['steady']}"})
                                               for _ in range(NUM_SLOTS + 2 + 4))))

    before = metric(limited, "specloop_limited_requests_total", reason="queue_full")
    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    assert len([r for r in responses if r.status_code == 200]) == NUM_SLOTS + 2  # the slots and max_waiting
    assert len(refused) == 4
    for r in refused:
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["Retry-After"]) >= 1
    assert metric(limited, "specloop_limited_requests_total", reason="queue_full") == before + 4
    assert limited.wait_idle()


def test_a_tenant_is_held_to_its_concurrent_sequences(limited: RunningServer, slow_decode: None) -> None:
    async def both() -> tuple[list[httpx.Response], httpx.Response]:
        body = _body(limited, ignore_eos=True, max_tokens=30)
        async with httpx.AsyncClient(timeout=60) as c:
            def post(key: str) -> asyncio.Future:
                return c.post(f"{limited.base_url}/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"})
            capped = asyncio.gather(*(post(KEYS["capped"]) for _ in range(4)))
            steady = post(KEYS["steady"])
            return await capped, await steady

    capped, steady = asyncio.run(both())
    assert sorted(r.status_code for r in capped) == [200, 200, 429, 429]
    assert steady.status_code == 200  # the other tenant is not held to the capped one's limit
    assert metric(limited, "specloop_limited_requests_total", reason="tenant_sequences") >= 2
    assert limited.wait_idle()


def test_the_client_that_reads_nothing_loses_its_stream_and_slot(tiny_loaded: LoadedModel,
                                                                 slow_decode: None) -> None:
    with serving(tiny_loaded, None, send_buffer=4096, send_timeout_s=1.0) as server:
        url = urlparse(server.base_url)
        body = json.dumps(_body(server, stream=True, ignore_eos=True, max_tokens=200, n=4))
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: the window it offers
            sock.connect((url.hostname, url.port))
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            deadline = time.monotonic() + 30
            while metric(server, "specloop_limited_requests_total", reason="slow_reader") == 0:
                assert time.monotonic() < deadline, "the unread stream was never ended"
                time.sleep(0.2)
            assert server.wait_idle(), "the unread stream still holds its slots"
        assert httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200


def test_a_request_that_waits_past_the_queue_timeout_is_503(tiny_loaded: LoadedModel, slow_decode: None) -> None:
    with serving(tiny_loaded, None, num_slots=1, queue_timeout_s=0.5) as server:
        async def two() -> list[httpx.Response]:
            long = _body(server, ignore_eos=True, max_tokens=150)
            async with httpx.AsyncClient(timeout=30) as c:
                first = asyncio.ensure_future(c.post(f"{server.base_url}/v1/chat/completions", json=long))
                await asyncio.sleep(0.3)
                second = await c.post(f"{server.base_url}/v1/chat/completions", json=_body(server))
                return [await first, second]

        first, second = asyncio.run(two())
        assert first.status_code == 200
        err = _error(second, 503)
        assert err["code"] == "queue_timeout" and int(second.headers["Retry-After"]) >= 1
        assert metric(server, "specloop_limited_requests_total", reason="queue_timeout") == 1


def test_a_tenants_request_rate_is_refused_before_the_body(tiny_loaded: LoadedModel) -> None:
    tenants = TenantDirectory([TenantPolicy(name="slow", api_keys=(KEYS["capped"],),
                                            limits=TenantLimits(requests_per_minute=2))], allow_anonymous=False)
    with serving(tiny_loaded, None, tenants) as server:
        assert [_post(server, _body(server), KEYS["capped"]).status_code for _ in range(2)] == [200, 200]
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEYS['capped']}\r\nContent-Length: {1 << 30}\r\n\r\n")
        answer, _ = _raw_exchange(server, head, b"{")
        assert answer.startswith(b"HTTP/1.1 429") and b"requests per minute" in answer, answer[:400]
        assert b"retry-after: " in answer.lower()


def test_a_tenants_tokens_per_minute_are_spent_then_refused(tiny_loaded: LoadedModel) -> None:
    tenants = TenantDirectory([TenantPolicy(name="t", api_keys=(KEYS["capped"],),
                                            limits=TenantLimits(tokens_per_minute=200))], allow_anonymous=False)
    with serving(tiny_loaded, None, tenants) as server:
        body = _body(server, max_tokens=60, ignore_eos=True)
        first = _post(server, body, KEYS["capped"])
        assert first.status_code == 200
        second = _post(server, body, KEYS["capped"])
        err = _error(second, 429)
        assert err["type"] == "tokens" and int(second.headers["Retry-After"]) >= 1
        assert _error(_post(server, _body(server, max_tokens=250), KEYS["capped"]), 400)["param"] == "max_tokens"


def test_health_and_metrics_answer_while_every_slot_is_busy(limited: RunningServer, slow_decode: None) -> None:
    async def busy() -> list[float]:
        body = _body(limited, ignore_eos=True, max_tokens=80)
        async with httpx.AsyncClient(timeout=60) as c:
            work = [asyncio.ensure_future(c.post(f"{limited.base_url}/v1/chat/completions", json=body,
                                                 headers={"Authorization": f"Bearer {KEYS['steady']}"}))
                    for _ in range(NUM_SLOTS)]
            await asyncio.sleep(0.3)
            took = []
            for path in ("/health", "/metrics", "/health"):
                started = time.monotonic()
                assert (await c.get(f"{limited.base_url}{path}", timeout=1)).status_code == 200
                took.append(time.monotonic() - started)
            await asyncio.gather(*work)
            return took

    assert max(asyncio.run(busy())) < 1

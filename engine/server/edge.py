"""The edge: an ASGI layer in front of the API routes that refuses what it can before reading a body.

FastAPI reads and JSON-parses a body before a route's dependencies run, so authentication there
would come after an unauthenticated client had made the server hold and parse whatever it sent. For
every `/v1` request this layer, in order and from the headers alone: resolves the bearer key to a
tenant (401 for a key it must refuse) and asks admission whether that tenant and the server have
room (429, `admission.py`). For every request with a body (`/admin` too) it refuses a declared
`Content-Length` over `max_body_bytes` (413); only then is the body read, counted as it arrives
(413 once past the limit, the rest never read), and handed to the app. The tenant travels in the
request's state to the routes.

It also bounds how long a response may wait on its client: a `send` that the client does not take
within `send_timeout_s` (a stream nobody reads; the socket's buffers are full) ends the request, so
its generation is aborted and its slot freed, counted as `slow_reader`.

Not here: the routes (`api.py`), what admission counts (`admission.py`), the limits' values
(`limits.py`).
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from specloop.consent.tenants import TenantDirectory, TenantPolicy
from specloop.engine.server.admission import Admission
from specloop.engine.server.errors import APIError
from specloop.engine.server.limits import RequestLimits
from specloop.engine.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
_WITH_BODY = ("POST", "PUT", "PATCH")


class ClientTooSlow(Exception):
    """The client took none of a response's bytes for `send_timeout_s`."""


def bearer_key(authorization: str | None) -> str | None:
    """The key of a `Bearer` header; any other scheme is returned whole, so it matches no key."""
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else authorization


def unauthenticated() -> APIError:
    return APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` with a key issued to "
                         "your tenant", code="invalid_api_key", kind="authentication_error")


def scope_tenant(scope: Scope) -> TenantPolicy | None:
    """The tenant the edge resolved for this request, if it did."""
    return scope.get("state", {}).get("tenant")


class Edge:
    """The ASGI middleware; everything outside `/v1` passes through untouched."""

    def __init__(self, app: ASGIApp, tenants: TenantDirectory, admission: Admission, limits: RequestLimits,
                 metrics: ServerMetrics) -> None:
        self.app, self.tenants, self.admission, self.limits, self.metrics = app, tenants, admission, limits, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            if scope["path"].startswith("/v1/"):
                tenant = self.tenants.resolve(bearer_key(headers.get("authorization")))
                if tenant is None:
                    raise unauthenticated()
                scope.setdefault("state", {})["tenant"] = tenant
                if scope["method"] == "POST":
                    self.admission.check_arrival(tenant)
            if scope["method"] in _WITH_BODY:
                receive = await self._read_body(headers, receive)
        except APIError as e:
            self._count(scope, e.status)
            await e.response()(scope, receive, send)
            return
        timed_out: list[ClientTooSlow] = []
        try:
            await self.app(scope, receive, self._bounded(send, timed_out))
        except Exception:
            if not timed_out:  # the app's own error
                raise
            # Starlette's exception middleware re-raises a started response's error as its own.
            self.metrics.limited.labels(reason="slow_reader").inc()
            log.info("%s %s: the client read nothing for %.0f s; request ended", scope["method"], scope["path"],
                     self.limits.send_timeout_s)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> Receive:
        """The body, read whole within the limit, as a `receive` that replays it (then waits for the disconnect)."""
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise _too_large(limit)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    def _bounded(self, send: Send, timed_out: list["ClientTooSlow"]) -> Send:
        async def bounded(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.limits.send_timeout_s)
            except TimeoutError as e:
                timed_out.append(ClientTooSlow())
                raise timed_out[-1] from e

        return bounded

    def _count(self, scope: Scope, status: int) -> None:
        if scope["path"] in ENDPOINTS:
            self.metrics.record_request(ENDPOINTS[scope["path"]], status)
        reason = {401: "unauthenticated", 413: "body_too_large"}.get(status)
        if reason:
            self.metrics.limited.labels(reason=reason).inc()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server takes: {limit} bytes "
                         f"(SPECLOOP_MAX_BODY_BYTES)", code="request_too_large")

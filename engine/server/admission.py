"""Admission: whether a request may start now, decided before its work begins.

Every refusal is OpenAI's 429 `rate_limit_exceeded` with a `Retry-After`, counted in `/metrics` by
reason (`specloop_limited_requests_total`):

| reason | when |
| --- | --- |
| `queue_full` | the engine's sequences in flight (running or waiting) would pass `num_slots + max_waiting` |
| `tenant_sequences` | the tenant's would pass its `max_concurrent_sequences` |
| `tenant_requests` | the tenant's `requests_per_minute` are spent |
| `tenant_tokens` | the tenant's `tokens_per_minute` are spent |

A request larger than its tenant may ever make (`n × max_tokens` over its `max_request_tokens`, or
more tokens than a minute's budget) is a 400 instead: retrying cannot help.

Two checks: `check_arrival` from the headers alone, before the body is read (`edge.py`): the
requests-per-minute budget, and whether the tenant or the server is already full; `reserve` once the
request is parsed and tokenized, which holds its sequences and tokens until the `Ticket` is released
(at the request's end, however it ends), giving back the tokens it did not generate. Budgets are
token buckets: a minute's worth, refilled continuously. All state lives on the server's event loop,
so nothing here locks.

Which waiting sequence gets the next free slot is the scheduler's (`engine/runtime/scheduler.py`).
"""

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from specloop.consent.tenants import TenantPolicy
from specloop.engine.server.errors import APIError, rate_limited
from specloop.engine.server.limits import RequestLimits
from specloop.engine.server.metrics import ServerMetrics

_QUEUE_FULL_RETRY_S = 1.0  # a slot frees every few engine steps under load


class Bucket:
    """`per_minute` units, refilled continuously, holding at most a minute's worth."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.per_minute, self._clock = per_minute, clock
        self._level, self._at = float(per_minute), clock()

    def take(self, units: int) -> float | None:
        """Take `units` now and return None, or return the seconds until they would be there (taking none)."""
        now = self._clock()
        self._level = min(self.per_minute, self._level + (now - self._at) * self.per_minute / 60)
        self._at = now
        if self._level >= units:
            self._level -= units
            return None
        return (units - self._level) * 60 / self.per_minute

    def give_back(self, units: int) -> None:
        self._level = min(self.per_minute, self._level + units)


@dataclass
class Ticket:
    """One admitted request's hold on sequences and tokens; `release` exactly once, at its end."""

    admission: "Admission"
    tenant: str
    sequences: int
    reserved_tokens: int
    released: bool = False

    def release(self, used_tokens: int) -> None:
        assert not self.released, "a ticket is released once"
        self.released = True
        self.admission._release(self, used_tokens)


class Admission:
    def __init__(self, num_slots: int, limits: RequestLimits, metrics: ServerMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = num_slots + limits.max_waiting  # sequences in flight, every tenant together
        self.limits, self.metrics, self._clock = limits, metrics, clock
        self.in_flight = 0
        self._by_tenant: defaultdict[str, int] = defaultdict(int)
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    def check_arrival(self, tenant: TenantPolicy) -> None:
        """Before the body is read: a 429 when the tenant's request budget is spent or it (or the
        server) holds all the sequences it may. Takes one request from the budget."""
        limits = tenant.limits
        if self.in_flight >= self.capacity:
            raise self._refuse("queue_full", "the server's queue is full; retry shortly", "requests",
                               _QUEUE_FULL_RETRY_S)
        if limits.max_concurrent_sequences is not None and \
                self._by_tenant[tenant.name] >= limits.max_concurrent_sequences:
            raise self._refuse("tenant_sequences", f"tenant {tenant.name} already has "
                               f"{limits.max_concurrent_sequences} sequences in flight, its limit", "requests",
                               _QUEUE_FULL_RETRY_S)
        if limits.requests_per_minute is not None:
            wait = self._bucket(self._requests, tenant.name, limits.requests_per_minute).take(1)
            if wait is not None:
                raise self._refuse("tenant_requests", f"tenant {tenant.name} is limited to "
                                   f"{limits.requests_per_minute} requests per minute", "requests", wait)

    def reserve(self, tenant: TenantPolicy, n: int, prompt_tokens: int, max_tokens: int,
                tokens_field: str) -> Ticket:
        """Hold `n` sequences and `prompt_tokens + n × max_tokens` tokens for this request, or refuse it:
        400 naming `tokens_field` when it is larger than its tenant may ever ask, 429 when not now."""
        limits = tenant.limits
        request_cap = min(self.limits.max_request_tokens, limits.max_request_tokens or self.limits.max_request_tokens)
        if n * max_tokens > request_cap:
            raise APIError(400, f"n × {tokens_field} = {n} × {max_tokens} = {n * max_tokens} tokens; one request may "
                                f"generate at most {request_cap}", param=tokens_field)
        cost = prompt_tokens + n * max_tokens
        if limits.tokens_per_minute is not None and cost > limits.tokens_per_minute:
            raise APIError(400, f"this request needs {cost} tokens (prompt plus n × {tokens_field}); tenant "
                                f"{tenant.name} may use {limits.tokens_per_minute} per minute", param=tokens_field)
        if self.in_flight + n > self.capacity:
            raise self._refuse("queue_full", "the server's queue is full; retry shortly", "requests",
                               _QUEUE_FULL_RETRY_S)
        if limits.max_concurrent_sequences is not None and \
                self._by_tenant[tenant.name] + n > limits.max_concurrent_sequences:
            raise self._refuse("tenant_sequences", f"tenant {tenant.name} may have "
                               f"{limits.max_concurrent_sequences} sequences in flight; this request needs {n} more",
                               "requests", _QUEUE_FULL_RETRY_S)
        if limits.tokens_per_minute is not None:
            wait = self._bucket(self._tokens, tenant.name, limits.tokens_per_minute).take(cost)
            if wait is not None:
                raise self._refuse("tenant_tokens", f"tenant {tenant.name} is limited to {limits.tokens_per_minute} "
                                   f"tokens per minute; this request needs {cost}", "tokens", wait)
        self.in_flight += n
        self._by_tenant[tenant.name] += n
        return Ticket(self, tenant.name, n, n * max_tokens if limits.tokens_per_minute is not None else 0)

    def _release(self, ticket: Ticket, used_tokens: int) -> None:
        self.in_flight -= ticket.sequences
        self._by_tenant[ticket.tenant] -= ticket.sequences
        assert self.in_flight >= 0 and self._by_tenant[ticket.tenant] >= 0
        if not self._by_tenant[ticket.tenant]:
            del self._by_tenant[ticket.tenant]
        unused = ticket.reserved_tokens - used_tokens
        if unused > 0 and ticket.tenant in self._tokens:
            self._tokens[ticket.tenant].give_back(unused)

    def _bucket(self, buckets: dict[str, Bucket], tenant: str, per_minute: int) -> Bucket:
        bucket = buckets.get(tenant)
        if bucket is None or bucket.per_minute != per_minute:
            bucket = buckets[tenant] = Bucket(per_minute, self._clock)
        return bucket

    def _refuse(self, reason: str, message: str, kind: str, retry_after_s: float) -> APIError:
        self.metrics.limited.labels(reason=reason).inc()
        return rate_limited(message, kind, retry_after_s)

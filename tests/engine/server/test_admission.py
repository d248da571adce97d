"""Admission as pure logic, on a hand-driven clock: the queue bound, a tenant's sequences, its request
and token budgets refilling over a minute, and tickets giving back what they did not use."""

import pytest

from specloop.consent.tenants import TenantLimits, TenantPolicy
from specloop.engine.runtime.llm_engine import EngineStats
from specloop.engine.server.admission import Admission, Bucket
from specloop.engine.server.errors import APIError
from specloop.engine.server.limits import RequestLimits
from specloop.engine.server.metrics import ServerMetrics

LIMITS = RequestLimits(max_body_bytes=1 << 20, max_prompt_chars=1000, max_request_tokens=1000, max_schema_bytes=1024,
                       max_schema_depth=8, max_waiting=2, send_timeout_s=30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def admission(clock: Clock, num_slots: int = 2) -> Admission:
    return Admission(num_slots, LIMITS, ServerMetrics(EngineStats), clock)


def tenant(name: str = "t", **limits: int) -> TenantPolicy:
    return TenantPolicy(name=name, limits=TenantLimits(**limits))


def refused(call, status: int = 429) -> APIError:  # noqa: ANN001 - a thunk
    with pytest.raises(APIError) as e:
        call()
    assert e.value.status == status, e.value
    return e.value


def test_a_bucket_refills_over_a_minute(clock: Clock) -> None:
    bucket = Bucket(60, clock)
    assert bucket.take(60) is None
    assert bucket.take(1) == pytest.approx(1.0)  # one unit a second
    clock.now = 30
    assert bucket.take(30) is None and bucket.take(10) == pytest.approx(10.0)
    clock.now = 1000
    assert bucket.take(60) is None and bucket.take(1) is not None  # never more than a minute's worth


def test_the_queue_holds_slots_plus_max_waiting_sequences(clock: Clock) -> None:
    a = admission(clock)
    tickets = [a.reserve(tenant(), 1, 10, 10, "max_tokens") for _ in range(4)]  # 2 slots + 2 waiting
    error = refused(lambda: a.reserve(tenant(), 1, 10, 10, "max_tokens"))
    assert error.body.code == "rate_limit_exceeded" and error.retry_after_s >= 1
    refused(lambda: a.check_arrival(tenant()))  # from the headers alone, too
    tickets[0].release(10)
    assert a.reserve(tenant(), 1, 10, 10, "max_tokens")
    with pytest.raises(AssertionError):
        tickets[0].release(0)  # once


def test_n_choices_count_as_n_sequences(clock: Clock) -> None:
    a = admission(clock)
    a.reserve(tenant(), 3, 10, 10, "max_tokens")
    refused(lambda: a.reserve(tenant(), 2, 10, 10, "max_tokens"))
    assert a.reserve(tenant(), 1, 10, 10, "max_tokens")


def test_a_tenant_is_held_to_its_sequences_and_others_are_not(clock: Clock) -> None:
    a = admission(clock, num_slots=8)
    capped = tenant("capped", max_concurrent_sequences=2)
    ticket = a.reserve(capped, 2, 10, 10, "max_tokens")
    refused(lambda: a.check_arrival(capped))
    refused(lambda: a.reserve(capped, 1, 10, 10, "max_tokens"))
    assert a.reserve(tenant("other"), 2, 10, 10, "max_tokens")
    ticket.release(0)
    assert a.reserve(capped, 2, 10, 10, "max_tokens")


def test_requests_per_minute_are_spent_at_arrival(clock: Clock) -> None:
    a = admission(clock)
    slow = tenant(requests_per_minute=2)
    a.check_arrival(slow)
    a.check_arrival(slow)
    error = refused(lambda: a.check_arrival(slow))
    assert error.body.type == "requests" and error.retry_after_s == pytest.approx(30.0)
    clock.now = 30
    a.check_arrival(slow)


def test_tokens_per_minute_are_reserved_and_unused_ones_given_back(clock: Clock) -> None:
    a = admission(clock, num_slots=8)
    t = tenant(tokens_per_minute=300)
    first = a.reserve(t, 2, 20, 100, "max_tokens")  # 20 + 2 × 100 = 220
    error = refused(lambda: a.reserve(t, 1, 20, 100, "max_tokens"))  # 120 more: 80 left
    assert error.body.type == "tokens" and error.retry_after_s == pytest.approx(40 * 60 / 300)
    first.release(used_tokens=50)  # 150 of the 200 completion tokens were never generated
    assert a.reserve(t, 1, 20, 100, "max_tokens")
    assert refused(lambda: a.reserve(t, 1, 100, 250, "max_tokens"), 400).body.param == "max_tokens"  # never fits


def test_a_request_larger_than_allowed_is_400_naming_the_field(clock: Clock) -> None:
    a = admission(clock, num_slots=64)
    error = refused(lambda: a.reserve(tenant(), 16, 10, 100, "max_completion_tokens"), 400)
    assert error.body.param == "max_completion_tokens" and "16 × 100 = 1600" in str(error)
    own = tenant(max_request_tokens=50)
    assert "at most 50" in str(refused(lambda: a.reserve(own, 1, 10, 51, "max_tokens"), 400))
    assert a.in_flight == 0

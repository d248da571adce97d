"""Capture decisions: one test per reason, the metric, and robustness to hostile user data."""

import sqlite3
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from specloop.consent.capture import CaptureDecision, CapturePolicy, CaptureReason
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.consent.tenants import TenantDirectory

T0 = datetime(2025, 6, 1, tzinfo=UTC)
NOW = T0 + timedelta(days=1)
CLEAN = ("What is speculative decoding?", "It drafts tokens and verifies them in one pass.")


@pytest.fixture
def metrics() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def policy(
    registry: ConsentRegistry,
    tenants: TenantDirectory,
    pseudonymizer: Pseudonymizer,
    metrics: CollectorRegistry,
) -> CapturePolicy:
    return CapturePolicy(registry, tenants, pseudonymizer, "drop", metrics)


def grant(registry: ConsentRegistry, pseudonymizer: Pseudonymizer, tenant: str, user: str,
          **kwargs: object) -> str:
    subject = pseudonymizer.subject(tenant, user)
    return registry.grant(tenant, subject, "drafter_training", "2025-06", "test", T0,
                          **kwargs).consent_id


def count(metrics: CollectorRegistry, reason: str) -> float:
    return metrics.get_sample_value("specloop_capture_decisions_total", {"reason": reason})


def test_captured_with_stamp(policy: CapturePolicy, registry: ConsentRegistry,
                             pseudonymizer: Pseudonymizer, metrics: CollectorRegistry) -> None:
    consent_id = grant(registry, pseudonymizer, "acme", "u1")
    decision = policy.decide("acme", "u1", *CLEAN, NOW)
    assert decision == CaptureDecision(True, CaptureReason.CAPTURED,
                                       pseudonymizer.subject("acme", "u1"), consent_id, "2025-06")
    assert count(metrics, "captured") == 1
    assert count(metrics, "no_consent") == 0  # every reason is exported from the start


@pytest.mark.parametrize(
    ("tenant", "user", "reason"),
    [
        ("nobody", "u1", CaptureReason.UNKNOWN_TENANT),
        ("initech", "u1", CaptureReason.TENANT_DISALLOWS),
        ("anonymous", "u1", CaptureReason.TENANT_DISALLOWS),
        ("acme", None, CaptureReason.NO_USER),
        ("acme", "", CaptureReason.NO_USER),
        ("acme", "stranger", CaptureReason.NO_CONSENT),
    ],
)
def test_not_captured_without_grant(policy: CapturePolicy, metrics: CollectorRegistry,
                                    tenant: str, user: str | None, reason: CaptureReason) -> None:
    decision = policy.decide(tenant, user, *CLEAN, NOW)
    assert (decision.capture, decision.reason) == (False, reason)
    assert count(metrics, reason.value) == 1
    assert count(metrics, "captured") == 0


def test_revoked(policy: CapturePolicy, registry: ConsentRegistry,
                 pseudonymizer: Pseudonymizer) -> None:
    grant(registry, pseudonymizer, "acme", "u1")
    registry.revoke("acme", pseudonymizer.subject("acme", "u1"), at=NOW - timedelta(hours=1))
    assert policy.decide("acme", "u1", *CLEAN, NOW).reason is CaptureReason.CONSENT_REVOKED
    # Before the revocation the same request would have been captured.
    assert policy.decide("acme", "u1", *CLEAN, NOW - timedelta(hours=2)).capture


def test_expired(policy: CapturePolicy, registry: ConsentRegistry,
                 pseudonymizer: Pseudonymizer) -> None:
    grant(registry, pseudonymizer, "acme", "u1", expires_at=NOW - timedelta(seconds=1))
    assert policy.decide("acme", "u1", *CLEAN, NOW).reason is CaptureReason.CONSENT_EXPIRED


def test_consent_is_per_tenant(policy: CapturePolicy, registry: ConsentRegistry,
                               pseudonymizer: Pseudonymizer) -> None:
    grant(registry, pseudonymizer, "globex", "u1")
    assert policy.decide("acme", "u1", *CLEAN, NOW).reason is CaptureReason.NO_CONSENT


@pytest.mark.parametrize("where", ["prompt", "response"])
def test_pii_dropped_by_default(policy: CapturePolicy, registry: ConsentRegistry,
                                pseudonymizer: Pseudonymizer, where: str) -> None:
    grant(registry, pseudonymizer, "acme", "u1")
    texts = [*CLEAN]
    texts[where == "response"] += " reach me at carol@example.com"
    decision = policy.decide("acme", "u1", *texts, NOW)
    assert (decision.capture, decision.reason, decision.strip_text) == (
        False, CaptureReason.PII_DROPPED, False)


def test_pii_stripped_when_tenant_says_so(policy: CapturePolicy, registry: ConsentRegistry,
                                          pseudonymizer: Pseudonymizer) -> None:
    consent_id = grant(registry, pseudonymizer, "globex", "u1")
    decision = policy.decide("globex", "u1", "my card 4111 1111 1111 1111", "noted", NOW)
    assert (decision.capture, decision.reason, decision.strip_text) == (
        True, CaptureReason.PII_STRIPPED, True)
    assert decision.consent_id == consent_id


def test_global_strip_mode(registry: ConsentRegistry, tenants: TenantDirectory,
                           pseudonymizer: Pseudonymizer) -> None:
    policy = CapturePolicy(registry, tenants, pseudonymizer, "strip", CollectorRegistry())
    grant(registry, pseudonymizer, "acme", "u1")
    assert policy.decide("acme", "u1", "ip 203.0.113.9", "", NOW).reason is CaptureReason.PII_STRIPPED


def test_registry_failure_is_a_decision_not_an_exception(
    policy: CapturePolicy, registry: ConsentRegistry, metrics: CollectorRegistry
) -> None:
    registry.close()  # every query now raises sqlite3.ProgrammingError
    with pytest.raises(sqlite3.Error):
        registry.list()
    assert policy.decide("acme", "u1", *CLEAN, NOW).reason is CaptureReason.REGISTRY_ERROR
    assert count(metrics, "registry_error") == 1


@pytest.mark.parametrize(
    "user", ["\ud800", "x" * 100_000, "'; DROP TABLE consent; --", "\x00", "ü" * 10]
)
def test_hostile_user_data_never_raises(policy: CapturePolicy, registry: ConsentRegistry,
                                        pseudonymizer: Pseudonymizer, user: str) -> None:
    grant(registry, pseudonymizer, "acme", user)
    hostile_text = "\ud800\x00" + "a@" * 1000 + "\u202e"
    assert policy.decide("acme", user, *CLEAN, NOW).capture
    assert policy.decide("acme", user, hostile_text, hostile_text, NOW).reason in (
        CaptureReason.CAPTURED, CaptureReason.PII_DROPPED)
    assert len(registry.list(tenant="acme")) == 1


def test_metric_rendered_for_scrape(policy: CapturePolicy, metrics: CollectorRegistry) -> None:
    policy.decide("initech", "u1", *CLEAN, NOW)
    text = generate_latest(metrics).decode()
    assert 'specloop_capture_decisions_total{reason="tenant_disallows"} 1.0' in text
    assert 'specloop_capture_decisions_total{reason="pii_dropped"} 0.0' in text

"""The capture decision: may this finished request become a trace, and with its text or without?

The engine calls `CapturePolicy.decide` once per finished request. Checks run cheapest first:
tenant policy, presence of a user, consent in force (one indexed SQLite lookup), then the PII and
secret detectors over prompt and response. Every decision is counted by reason in
`specloop_capture_decisions_total`. `decide` never raises on anything a client sent; a registry
failure becomes `registry_error` (not captured). This module does not build or send the trace.

PII mode "strip" keeps the trace without what was found: the engine's capture hook removes the
tokens that spell it (`consent/redaction.py`) and blanks the text fields; "drop" (the default)
keeps no trace at all.
"""

import logging
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter

from specloop.consent import pii
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRecord, ConsentRegistry
from specloop.consent.settings import PiiMode
from specloop.consent.tenants import TenantDirectory, TenantPolicy

log = logging.getLogger(__name__)


class CaptureReason(StrEnum):
    CAPTURED = "captured"
    PII_STRIPPED = "pii_stripped"
    UNKNOWN_TENANT = "unknown_tenant"
    TENANT_DISALLOWS = "tenant_disallows"
    NO_USER = "no_user"
    NO_CONSENT = "no_consent"
    CONSENT_REVOKED = "consent_revoked"
    CONSENT_EXPIRED = "consent_expired"
    PII_DROPPED = "pii_dropped"
    REGISTRY_ERROR = "registry_error"


@dataclass(frozen=True, slots=True)
class CaptureDecision:
    """`capture` true means: produce the trace, stamped with subject, consent id and policy version;
    with `strip_text`, without what the detectors found (`consent/redaction.py`)."""

    capture: bool
    reason: CaptureReason
    subject: str | None = None
    consent_id: str | None = None
    policy_version: str | None = None
    strip_text: bool = False

    def __post_init__(self) -> None:
        captured = self.reason in (CaptureReason.CAPTURED, CaptureReason.PII_STRIPPED)
        assert self.capture == captured, self.reason
        assert not self.capture or (self.subject and self.consent_id and self.policy_version)
        assert self.strip_text == (self.reason is CaptureReason.PII_STRIPPED)


class CapturePolicy:
    """Per-request capture decisions for all tenants. Thread-safe; share one per process."""

    def __init__(
        self,
        registry: ConsentRegistry,
        tenants: TenantDirectory,
        pseudonymizer: Pseudonymizer,
        pii_mode: PiiMode,
        metrics: CollectorRegistry,
    ) -> None:
        self._registry = registry
        self._tenants = tenants
        self._pseudonymizer = pseudonymizer
        self._pii_mode = pii_mode
        counter = Counter(
            "specloop_capture_decisions",
            "Capture decisions for finished requests, by reason",
            ["reason"],
            registry=metrics,
        )
        # Children bound up front: every reason shows in /metrics from the start, at 0, and the
        # hot path skips the label lookup.
        self._counts = {reason: counter.labels(reason.value) for reason in CaptureReason}

    def decide(
        self, tenant: str, user: str | None, prompt_text: str, response_text: str, at: datetime
    ) -> CaptureDecision:
        """Decide for one finished request of `tenant` by `user` (the OpenAI `user` field)."""
        decision = self._decide(tenant, user, prompt_text, response_text, at)
        self._counts[decision.reason].inc()
        return decision

    def _decide(
        self, tenant: str, user: str | None, prompt_text: str, response_text: str, at: datetime
    ) -> CaptureDecision:
        policy = self._tenants.get(tenant)
        if policy is None:
            return CaptureDecision(False, CaptureReason.UNKNOWN_TENANT)
        if not policy.capture_allowed:
            return CaptureDecision(False, CaptureReason.TENANT_DISALLOWS)
        if not user:
            return CaptureDecision(False, CaptureReason.NO_USER)
        subject = self._pseudonymizer.subject(tenant, user)
        try:
            record = self._registry.active(tenant, subject, policy.purpose, at)
            if record is None:
                return CaptureDecision(False, self._why_not(policy, subject, at), subject)
        except sqlite3.Error:
            log.exception("consent registry lookup failed; not capturing")
            return CaptureDecision(False, CaptureReason.REGISTRY_ERROR, subject)
        return self._screen(policy, record, prompt_text, response_text)

    def _why_not(self, policy: TenantPolicy, subject: str, at: datetime) -> CaptureReason:
        latest = self._registry.latest(policy.name, subject, policy.purpose, at)
        if latest is None:
            return CaptureReason.NO_CONSENT
        if latest.revoked_at is not None and latest.revoked_at <= at:
            return CaptureReason.CONSENT_REVOKED
        assert latest.expires_at is not None and latest.expires_at <= at, latest
        return CaptureReason.CONSENT_EXPIRED

    def _screen(
        self, policy: TenantPolicy, record: ConsentRecord, prompt_text: str, response_text: str
    ) -> CaptureDecision:
        stamp = (record.subject, record.consent_id, record.policy_version)
        if _has_pii(prompt_text) or _has_pii(response_text):
            if (policy.pii_mode or self._pii_mode) == "drop":
                return CaptureDecision(False, CaptureReason.PII_DROPPED, record.subject)
            return CaptureDecision(True, CaptureReason.PII_STRIPPED, *stamp, strip_text=True)
        return CaptureDecision(True, CaptureReason.CAPTURED, *stamp)


def _has_pii(text: str) -> bool:
    return next(pii.findings(text), None) is not None

"""Consent administration: the grant, revoke and list operations behind both the CLI and the API.

It turns what an operator names (a tenant, a raw user id or a pseudonym) into registry calls,
fills purpose and policy version from the tenant's policy, audits every change, and raises
`InvalidField` naming the offending field for anything the operator got wrong. It is not
transport: `specloop.consent.cli` and `specloop.consent.admin_api` only parse arguments and render results.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from specloop.consent.audit import append_audit
from specloop.consent.erasure import TraceEraser, revoke_and_erase
from specloop.consent.pseudonym import Pseudonymizer, is_pseudonym
from specloop.consent.registry import ConsentRecord, ConsentRegistry, InvalidField
from specloop.consent.settings import ConsentConfig
from specloop.consent.tenants import TenantDirectory, TenantPolicy


@dataclass(frozen=True)
class RevokeOutcome:
    revoked: list[ConsentRecord]
    erasure: dict[str, Any] | None


class ConsentService:
    """Admin operations over one registry. Thread-safe as the registry is.

    `erase_traces` is storage's eraser, given by whoever wires consent to storage
    (`consent/erasure.py`); without it a revoke with erasure is refused.
    """

    def __init__(
        self, registry: ConsentRegistry, config: ConsentConfig, tenants: TenantDirectory,
        erase_traces: TraceEraser | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.tenants = tenants
        self.erase_traces = erase_traces
        self._pseudonymizer = Pseudonymizer(config.hmac_key)

    def subject_of(self, tenant: str, user: str | None, subject: str | None) -> str:
        """The pseudonym named by exactly one of a raw `user` id or a `subject` pseudonym."""
        if (user is None) == (subject is None):
            raise InvalidField("user", "give exactly one of user or subject")
        if subject is not None:
            if not is_pseudonym(subject):
                raise InvalidField("subject", "must be a pseudonym (64 lowercase hex digits)")
            return subject
        if not user:
            raise InvalidField("user", "must not be empty")
        return self._pseudonymizer.subject(tenant, user)

    def grant(
        self,
        tenant: str,
        user: str | None,
        subject: str | None,
        purpose: str | None,
        policy_version: str | None,
        expires_at: datetime | None,
        source: str,
        actor: str,
    ) -> ConsentRecord:
        policy = self._tenant(tenant)
        version = policy_version or policy.policy_version
        if not version:
            raise InvalidField("policy_version", f"tenant {tenant!r} has none; give one")
        record = self.registry.grant(
            tenant, self.subject_of(tenant, user, subject), purpose or policy.purpose, version,
            source, expires_at=expires_at,
        )
        append_audit(self.config.audit_log_path, "grant", actor, **record_fields(record))
        return record

    def revoke(
        self,
        tenant: str,
        user: str | None,
        subject: str | None,
        purpose: str | None,
        erase: bool,
        actor: str,
    ) -> RevokeOutcome:
        self._tenant(tenant)
        pseudonym = self.subject_of(tenant, user, subject)
        if erase:
            if self.erase_traces is None:
                raise InvalidField("erase", "trace erasure is not available here")
            revoked, entry = revoke_and_erase(self.registry, self.erase_traces, self.config.traces_root,
                                              self.config.work_dir, tenant, pseudonym, self.config.audit_log_path,
                                              actor, purpose)
            return RevokeOutcome(revoked, entry)
        revoked = self.registry.revoke(tenant, pseudonym, purpose)
        append_audit(self.config.audit_log_path, "revoke", actor, tenant=tenant, subject=pseudonym,
                     purpose=purpose, consents_revoked=[r.consent_id for r in revoked])
        return RevokeOutcome(revoked, None)

    def list(
        self, tenant: str | None, user: str | None, subject: str | None, purpose: str | None
    ) -> list[ConsentRecord]:
        named = user is not None or subject is not None
        if named and tenant is None:
            raise InvalidField("tenant", "required when filtering by user or subject")
        pseudonym = self.subject_of(tenant, user, subject) if named else None
        return self.registry.list(tenant, pseudonym, purpose)

    def _tenant(self, name: str) -> TenantPolicy:
        policy = self.tenants.get(name)
        if policy is None:
            raise InvalidField("tenant", f"unknown tenant {name!r}")
        return policy


def record_fields(record: ConsentRecord) -> dict[str, Any]:
    """A record as JSON-ready fields, timestamps in ISO 8601 (UTC)."""
    return {
        "consent_id": record.consent_id,
        "tenant": record.tenant,
        "subject": record.subject,
        "purpose": record.purpose,
        "policy_version": record.policy_version,
        "granted_at": record.granted_at.isoformat(),
        "expires_at": record.expires_at and record.expires_at.isoformat(),
        "revoked_at": record.revoked_at and record.revoked_at.isoformat(),
        "source": record.source,
    }


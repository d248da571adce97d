"""Tenant policies from YAML, and the mapping from a bearer API key to its tenant.

A tenant says whether its traffic may be captured at all, for which purpose and under which policy
version, may override the PII mode, and may be held to limits of its own (`TenantLimits`). Keys are
kept only as SHA-256 digests once loaded and are compared in constant time. Without a tenants file
(`make run`) every request belongs to the anonymous tenant, which is never captured. This module
does not check consent or authenticate the admin API; see `deploy/tenants.example.yaml` for the
format.
"""

import hashlib
import hmac
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from specloop.consent.settings import PiiMode

ANONYMOUS_NAME = "anonymous"
DEFAULT_PURPOSE = "drafter_training"


class TenantLimits(BaseModel):
    """What one tenant may ask of a server at once; None: no limit of its own (the server's apply).

    Enforced by the serving engine (`engine/server/admission.py`), before a request's body is read
    where the header is enough (requests per minute, sequences in flight)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent_sequences: int | None = Field(None, ge=1)  # running or waiting, every choice counted
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt tokens plus n × max_tokens, reserved at the start
    max_request_tokens: int | None = Field(None, ge=1)  # n × max_tokens of one request


_PLACEHOLDER = re.compile(r"(?i)replace|change-?me|placeholder|example|your[-_]?(?:api[-_]?)?key|[<>]|x{6,}")


class TenantPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    api_keys: tuple[SecretStr, ...] = ()
    api_key_sha256: tuple[str, ...] = ()
    # SHA-256 of this tenant's own admin tokens: they grant, revoke, erase and list for this tenant only.
    admin_token_sha256: tuple[str, ...] = ()
    capture_allowed: bool = False
    purpose: str = Field(default=DEFAULT_PURPOSE, pattern=r"^[a-z][a-z0-9_]{0,63}$")
    policy_version: str | None = None
    pii_mode: PiiMode | None = None
    limits: TenantLimits = TenantLimits()
    # Suffix decoding drafts from this tenant's recent requests, kept in the engine's memory only and
    # never shared with another tenant (engine/speculation/suffix_cache.py); false: from each request alone.
    suffix_cache: bool = True
    # Days this tenant's traces are kept; None: the deployment's default (the daemon applies both,
    # daemon/retrain/retention.py).
    retention_days: float | None = Field(default=None, gt=0, le=36_500)  # a century: any longer overflows a date

    @model_validator(mode="after")
    def _check(self) -> "TenantPolicy":
        if self.capture_allowed and not self.policy_version:
            raise ValueError("policy_version is required when capture_allowed is true")
        if any(len(k.get_secret_value()) < 16 for k in self.api_keys):
            raise ValueError("api_keys: each key must be at least 16 characters")
        if any(_PLACEHOLDER.search(k.get_secret_value()) for k in self.api_keys):
            # A key copied from an example is known to everyone who read it: the tenant's traffic,
            # captured under its consent, would be anyone's to send.
            raise ValueError("api_keys: a key looks like a placeholder (replace-with, changeme, example, <...>); "
                             "generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        for field in ("api_key_sha256", "admin_token_sha256"):
            digests = getattr(self, field)
            if any(len(d) != 64 or d.strip("0123456789abcdef") for d in digests):
                raise ValueError(f"{field}: each entry must be 64 lowercase hex digits")
        return self

    def key_digests(self) -> tuple[bytes, ...]:
        plain = (_digest(k.get_secret_value()) for k in self.api_keys)
        return (*plain, *(bytes.fromhex(d) for d in self.api_key_sha256))


ANONYMOUS = TenantPolicy(name=ANONYMOUS_NAME, capture_allowed=False)


class TenantsFile(BaseModel):
    """The whole YAML document."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow_anonymous: bool = False
    # A key no tenant holds: refused (401), or, when true, served as anonymous like no key. Off in
    # production, where a mistyped key should fail loudly; on in `specloop up --demo`, so that the
    # official `openai` client, which always sends some key, reaches the demo server.
    anonymous_unknown_keys: bool = False
    tenants: tuple[TenantPolicy, ...]

    @model_validator(mode="after")
    def _unique(self) -> "TenantsFile":
        if self.anonymous_unknown_keys and not self.allow_anonymous:
            raise ValueError("anonymous_unknown_keys: needs allow_anonymous: true")
        names = [t.name for t in self.tenants]
        if ANONYMOUS_NAME in names:
            raise ValueError(f"tenants: the name {ANONYMOUS_NAME!r} is reserved")
        if len(set(names)) != len(names):
            raise ValueError("tenants: names must be unique")
        digests = [d for t in self.tenants for d in t.key_digests()]
        if len(set(digests)) != len(digests):
            raise ValueError("tenants: an API key is listed more than once")
        admin = [d for t in self.tenants for d in t.admin_token_sha256]
        if len(set(admin)) != len(admin) or {bytes.fromhex(d) for d in admin} & set(digests):
            raise ValueError("tenants: an admin token is listed more than once, or is also an API key")
        return self


class TenantDirectory:
    """Resolves API keys and names to tenant policies. Immutable, so safe across threads."""

    def __init__(self, tenants: Sequence[TenantPolicy], allow_anonymous: bool,
                 anonymous_unknown_keys: bool = False) -> None:
        assert allow_anonymous or not anonymous_unknown_keys
        self.allow_anonymous, self.anonymous_unknown_keys = allow_anonymous, anonymous_unknown_keys
        self._by_name = {t.name: t for t in (*tenants, ANONYMOUS)}
        self._keys = [(d, t) for t in tenants for d in t.key_digests()]
        self._admin = [(bytes.fromhex(d), t.name) for t in tenants for d in t.admin_token_sha256]

    @classmethod
    def load(cls, path: Path | None) -> "TenantDirectory":
        """Tenants from a YAML file; with no file, only the anonymous tenant, for any key."""
        if path is None:
            return cls((), allow_anonymous=True)
        parsed = parse_tenants(path)
        return cls(parsed.tenants, parsed.allow_anonymous, parsed.anonymous_unknown_keys)

    def resolve(self, api_key: str | None) -> TenantPolicy | None:
        """The tenant owning `api_key` (a bearer token), or None when the key must be refused.

        No key, or any key when no tenant has keys configured, gives the anonymous tenant if
        anonymous use is allowed; so does a key no tenant holds, with `anonymous_unknown_keys`.
        Every digest is compared, so timing does not reveal a prefix.
        """
        if api_key is None or not self._keys:
            return ANONYMOUS if self.allow_anonymous else None
        presented = _digest(api_key)
        found = ANONYMOUS if self.anonymous_unknown_keys else None
        for digest, tenant in self._keys:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found

    def get(self, name: str) -> TenantPolicy | None:
        return self._by_name.get(name)

    def admin_scope(self, token: str) -> str | None:
        """The tenant whose own admin token `token` is, or None. Every digest is compared."""
        presented, found = _digest(token), None
        for digest, tenant in self._admin:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found


def parse_tenants(path: Path) -> TenantsFile:
    """Read and validate a tenants YAML file; ValueError names the file and the field."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"tenants file {path}: {exc}") from exc
    try:
        return TenantsFile.model_validate(document)
    except ValidationError as exc:
        raise ValueError(f"tenants file {path}: {_describe(exc)}") from exc


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}" for e in exc.errors()
    )


def _digest(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).digest()

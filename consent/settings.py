"""Settings of the consent and capture side, read once from `SPECLOOP_*` environment variables.

`ConsentSettings` validates what the operator gave (placeholder or short secrets are refused with
an error naming the variable); `ConsentSettings.resolve()` turns it into a `ConsentConfig` with
every path and secret filled in. Secrets left unset are generated once and persisted in the data
directory, so `make run` works without configuration and no constant key ships in the code. This
module does not open the registry or read the tenants file.
"""

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PiiMode = Literal["drop", "strip"]

MIN_SECRET_CHARS = 32
SECRETS_FILE = "consent-secrets.json"
_PLACEHOLDERS = ("changeme", "change-me", "change_me", "secret", "password", "admin", "token",
                 "default", "example", "test", "xxx", "todo")


@dataclass(frozen=True)
class ConsentConfig:
    """Resolved consent settings: every secret present, every path absolute-or-relative but set."""

    hmac_key: bytes
    admin_token: str
    registry_path: Path
    audit_log_path: Path
    traces_root: Path
    work_dir: Path  # the retraining daemon's, whose run datasets erasure scrubs
    tenants_path: Path | None
    pii_mode: PiiMode


class ConsentSettings(BaseSettings):
    """`SPECLOOP_HMAC_KEY`, `SPECLOOP_ADMIN_TOKEN`, `SPECLOOP_CONSENT_DB`, `SPECLOOP_PII_MODE`, ..."""

    model_config = SettingsConfigDict(env_prefix="SPECLOOP_", extra="ignore", frozen=True)

    data_dir: Path = Path("data")
    hmac_key: SecretStr | None = None
    admin_token: SecretStr | None = None
    consent_db: Path | None = None
    audit_log: Path | None = None
    traces_root: Path | None = None
    daemon_work_dir: Path | None = None  # SPECLOOP_DAEMON_WORK_DIR, as the daemon reads it
    tenants_file: Path | None = None
    pii_mode: PiiMode = "drop"

    @field_validator("hmac_key", "admin_token")
    @classmethod
    def _refuse_weak(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_secret(value.get_secret_value())
        return value

    def resolve(self) -> ConsentConfig:
        """Fill unset secrets from (or into) `<data_dir>/consent-secrets.json` and unset paths."""
        stored = {} if self.hmac_key and self.admin_token else load_or_create_secrets(self.data_dir)
        hmac_key = self.hmac_key.get_secret_value() if self.hmac_key else stored["hmac_key"]
        admin = self.admin_token.get_secret_value() if self.admin_token else stored["admin_token"]
        return ConsentConfig(
            hmac_key=hmac_key.encode(),
            admin_token=admin,
            registry_path=self.consent_db or self.data_dir / "consent.db",
            audit_log_path=self.audit_log or self.data_dir / "consent-audit.jsonl",
            traces_root=self.traces_root or self.data_dir / "traces",
            work_dir=self.daemon_work_dir or self.data_dir / "daemon" / "runs",
            tenants_path=self.tenants_file,
            pii_mode=self.pii_mode,
        )


    def existing_admin_token(self) -> str | None:
        """The admin token engines check, without creating anything: `SPECLOOP_ADMIN_TOKEN`, else the
        persisted secrets file's when one exists; None when neither does (no engine has started yet)."""
        if self.admin_token is not None:
            return self.admin_token.get_secret_value()
        path = self.data_dir / SECRETS_FILE
        return load_or_create_secrets(self.data_dir)["admin_token"] if path.exists() else None


def check_secret(value: str) -> None:
    """Raise ValueError for a secret that is short or built around a placeholder word."""
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"must be at least {MIN_SECRET_CHARS} characters (got {len(value)})")
    lowered = value.lower()
    if lowered.startswith(_PLACEHOLDERS) or len(set(value)) < 8:
        raise ValueError("looks like a placeholder; generate one with `openssl rand -hex 32`")


def load_or_create_secrets(data_dir: Path) -> dict[str, str]:
    """The persisted embedded-default secrets, created with fresh random values on first use.

    Creation writes a private temp file and hard-links it into place, which fails if another
    process won the race; the loser then reads the winner's file, so all processes agree.
    """
    path = data_dir / SECRETS_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fresh = {"hmac_key": secrets.token_hex(32), "admin_token": secrets.token_urlsafe(32)}
        tmp = data_dir / f".{SECRETS_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(fresh, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    stored = json.loads(path.read_text())
    if not set(stored) >= {"hmac_key", "admin_token"}:
        raise ValueError(
            f"{path} must hold hmac_key and admin_token; restore it from a backup, since the key "
            "decides every subject pseudonym"
        )
    return stored

"""Consent settings: placeholder secrets refused, embedded defaults generated once and persisted."""

import json
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from specloop.consent.settings import ConsentSettings, load_or_create_secrets

STRONG = "q8Vn2LrT5wXy7Zb1Cd4Ef6Gh9Jk3Mn0Pq"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HMAC_KEY", "ADMIN_TOKEN", "DATA_DIR", "CONSENT_DB", "PII_MODE", "TENANTS_FILE"):
        monkeypatch.delenv(f"SPECLOOP_{name}", raising=False)


@pytest.mark.parametrize("value", ["changeme", "changeme" * 5, "secret-" + "x" * 30, "a" * 40,
                                   "short-but-random-9f8e"])
@pytest.mark.parametrize("field", ["HMAC_KEY", "ADMIN_TOKEN"])
def test_weak_secrets_refused(monkeypatch: pytest.MonkeyPatch, field: str, value: str) -> None:
    monkeypatch.setenv(f"SPECLOOP_{field}", value)
    with pytest.raises(ValidationError, match=field.lower()):
        ConsentSettings()


def test_env_values_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECLOOP_HMAC_KEY", STRONG)
    monkeypatch.setenv("SPECLOOP_ADMIN_TOKEN", STRONG[::-1])
    monkeypatch.setenv("SPECLOOP_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SPECLOOP_PII_MODE", "strip")
    config = ConsentSettings().resolve()
    assert (config.hmac_key, config.admin_token) == (STRONG.encode(), STRONG[::-1])
    assert config.registry_path == tmp_path / "consent.db"
    assert config.pii_mode == "strip"
    assert not (tmp_path / "consent-secrets.json").exists()


def test_pii_mode_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECLOOP_PII_MODE", "redact")
    with pytest.raises(ValidationError, match="pii_mode"):
        ConsentSettings()


def test_embedded_defaults_generated_once(tmp_path: Path) -> None:
    first = ConsentSettings(data_dir=tmp_path).resolve()
    second = ConsentSettings(data_dir=tmp_path).resolve()
    assert first.hmac_key == second.hmac_key and first.admin_token == second.admin_token
    assert len(first.hmac_key) >= 32
    path = tmp_path / "consent-secrets.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = ConsentSettings(data_dir=tmp_path / "elsewhere").resolve()
    assert other.hmac_key != first.hmac_key  # no constant key ships in the code
    assert list(tmp_path.glob(".*tmp")) == []


def test_lost_race_reads_winner(tmp_path: Path) -> None:
    winner = {"hmac_key": STRONG, "admin_token": STRONG[::-1]}
    (tmp_path / "consent-secrets.json").write_text(json.dumps(winner))
    assert load_or_create_secrets(tmp_path) == winner


def test_corrupt_secrets_file(tmp_path: Path) -> None:
    (tmp_path / "consent-secrets.json").write_text("{}")
    with pytest.raises(ValueError, match="restore it"):
        load_or_create_secrets(tmp_path)

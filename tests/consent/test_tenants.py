"""Tenant policies: YAML validation with field-naming errors, and API-key resolution."""

import hashlib
from pathlib import Path

import pytest

from specloop.consent.tenants import ANONYMOUS, TenantDirectory, parse_tenants

EXAMPLE = Path(__file__).parents[2] / "deploy" / "tenants.example.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_example_file_is_refused_until_its_placeholder_key_is_replaced(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tenants.1.*api_keys: a key looks like a placeholder"):
        parse_tenants(EXAMPLE)
    edited = write(tmp_path, EXAMPLE.read_text().replace("replace-with-a-long-random-key-0001", "k" * 12 + "Q7v2Lm9"))
    parsed = parse_tenants(edited)
    assert [t.name for t in parsed.tenants] == ["acme", "globex", "initech"]
    assert parsed.tenants[1].pii_mode == "strip"


@pytest.mark.parametrize("key", ["replace-with-a-long-random-key-0001", "CHANGEME-0123456789abc", "<your-api-key-here>",
                                 "my-example-key-0123456", "xxxxxxxxxxxxxxxxxxxxxxxx", "your_api_key_0123456789"])
def test_placeholder_keys_are_refused(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, f"tenants:\n  - name: acme\n    api_keys: [{key!r}]\n")
    with pytest.raises(ValueError, match="placeholder"):
        parse_tenants(path)


def test_resolve_plain_and_hashed_keys(tmp_path: Path) -> None:
    hashed = "hashed-key-0123456789abcdef"
    path = write(tmp_path, f"""
tenants:
  - name: acme
    api_keys: [plain-key-0123456789abcdef]
    capture_allowed: true
    policy_version: v1
  - name: globex
    api_key_sha256: [{hashlib.sha256(hashed.encode()).hexdigest()}]
""")
    directory = TenantDirectory.load(path)
    assert directory.resolve("plain-key-0123456789abcdef").name == "acme"
    assert directory.resolve(hashed).name == "globex"
    assert directory.resolve("plain-key-0123456789abcdeX") is None
    assert directory.resolve("") is None
    assert directory.resolve(None) is None  # allow_anonymous defaults to false
    assert directory.get("acme").capture_allowed
    assert directory.get("nope") is None


def test_anonymous_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, "allow_anonymous: true\ntenants: []\n")
    assert TenantDirectory.load(path).resolve(None) is ANONYMOUS


def test_unknown_keys_refused_unless_the_file_makes_them_anonymous(tmp_path: Path) -> None:
    tenant = "tenants:\n  - name: acme\n    api_keys: [plain-key-0123456789abcdef]\n"
    strict = TenantDirectory.load(write(tmp_path, "allow_anonymous: true\n" + tenant))
    assert strict.resolve("sk-anything-at-all") is None and strict.resolve(None) is ANONYMOUS
    lenient = TenantDirectory.load(write(tmp_path, "allow_anonymous: true\nanonymous_unknown_keys: true\n" + tenant))
    assert lenient.resolve("sk-anything-at-all") is ANONYMOUS and lenient.resolve(None) is ANONYMOUS
    assert lenient.resolve("plain-key-0123456789abcdef").name == "acme"
    with pytest.raises(ValueError, match="anonymous_unknown_keys: needs allow_anonymous"):
        parse_tenants(write(tmp_path, "anonymous_unknown_keys: true\n" + tenant))


def test_no_file_means_anonymous_without_capture() -> None:
    directory = TenantDirectory.load(None)
    for key in (None, "sk-anything-at-all"):
        tenant = directory.resolve(key)
        assert tenant is ANONYMOUS and not tenant.capture_allowed


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ("tenants:\n  - name: acme\n    capture_allowed: maybe\n", "tenants.0.capture_allowed"),
        ("tenants:\n  - name: acme\n    capture_allowed: true\n", "policy_version"),
        ("tenants:\n  - name: Acme Corp\n", "tenants.0.name"),
        ("tenants:\n  - name: acme\n    pii_mode: redact\n", "tenants.0.pii_mode"),
        ("tenants:\n  - name: acme\n    api_keys: [short]\n", "api_keys"),
        ("tenants:\n  - name: acme\n    api_key_sha256: [abc]\n", "api_key_sha256"),
        ("tenants:\n  - name: acme\n    colour: red\n", "tenants.0.colour"),
        ("tenants:\n  - name: acme\n  - name: acme\n", "unique"),
        ("tenants:\n  - name: anonymous\n", "reserved"),
        ("tenants:\n  - {name: a, api_keys: [k-0123456789abcdef]}\n"
         "  - {name: b, api_keys: [k-0123456789abcdef]}\n", "more than once"),
        ("allow_anonymous: true\n", "tenants"),
        ("tenants: [unclosed\n", "tenants.yaml"),
    ],
)
def test_bad_files_name_the_field(tmp_path: Path, body: str, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        parse_tenants(write(tmp_path, body))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing.yaml"):
        parse_tenants(tmp_path / "missing.yaml")


def test_an_admin_token_that_is_also_an_api_key_is_refused(tmp_path: Path) -> None:
    key = "acme-api-key-0123456789abcdef"
    digest = hashlib.sha256(key.encode()).hexdigest()
    path = write(tmp_path, f"tenants:\n  - name: acme\n    api_keys: [{key}]\n    admin_token_sha256: [{digest}]\n")
    with pytest.raises(ValueError, match="admin token .* also an API key"):
        parse_tenants(path)


def test_retention_days_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: acme\n    retention_days: 1.0e12\n")
    with pytest.raises(ValueError, match="retention_days"):
        parse_tenants(path)

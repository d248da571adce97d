"""Subject pseudonyms: stable, keyed, tenant-scoped, and the raw id never reaches the registry."""

import pytest

from specloop.consent.pseudonym import Pseudonymizer, is_pseudonym
from specloop.consent.registry import ConsentRegistry, InvalidField


def test_stable_and_shaped(pseudonymizer: Pseudonymizer) -> None:
    a = pseudonymizer.subject("acme", "user-42")
    assert a == pseudonymizer.subject("acme", "user-42")
    assert is_pseudonym(a)


def test_depends_on_key_tenant_and_user(pseudonymizer: Pseudonymizer) -> None:
    other_key = Pseudonymizer(b"another-key-for-tests-only-0123456789")
    base = pseudonymizer.subject("acme", "user-42")
    assert other_key.subject("acme", "user-42") != base
    assert pseudonymizer.subject("globex", "user-42") != base
    assert pseudonymizer.subject("acme", "user-43") != base
    # Concatenation ambiguity: ("ab", "c") must not collide with ("a", "bc").
    assert pseudonymizer.subject("ab", "c") != pseudonymizer.subject("a", "bc")


def test_lone_surrogate_user_does_not_raise(pseudonymizer: Pseudonymizer) -> None:
    assert is_pseudonym(pseudonymizer.subject("acme", "\ud800bad"))


def test_short_key_refused() -> None:
    with pytest.raises(ValueError, match="hmac_key"):
        Pseudonymizer(b"short")


def test_registry_refuses_raw_ids(registry: ConsentRegistry) -> None:
    with pytest.raises(InvalidField, match="subject"):
        registry.grant("acme", "alice@example.com", "drafter_training", "v1", "test")


def test_raw_id_absent_from_sqlite_bytes(
    registry: ConsentRegistry, pseudonymizer: Pseudonymizer
) -> None:
    raw = "alice.rawid.7731@example.com"
    registry.grant("acme", pseudonymizer.subject("acme", raw), "drafter_training", "v1", "test")
    registry.close()
    files = [registry.path, *registry.path.parent.glob(registry.path.name + "-*")]
    content = b"".join(p.read_bytes() for p in files)
    assert pseudonymizer.subject("acme", raw).encode() in content  # the bytes are searchable
    assert raw.encode() not in content
    assert b"alice.rawid" not in content

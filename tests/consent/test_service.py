"""`ConsentService` where no trace eraser was wired in: revoking still works, erasing is refused by name."""

import pytest

from specloop.consent.registry import ConsentRegistry, InvalidField
from specloop.consent.service import ConsentService
from specloop.consent.settings import ConsentConfig
from specloop.consent.tenants import TenantDirectory


def test_erase_without_an_eraser_is_refused_and_revokes_nothing(
    registry: ConsentRegistry, config: ConsentConfig, tenants: TenantDirectory
) -> None:
    service = ConsentService(registry, config, tenants)
    record = service.grant("acme", "bob", None, None, None, None, "test", "test:ops")

    with pytest.raises(InvalidField) as refused:
        service.revoke("acme", "bob", None, None, erase=True, actor="test:ops")

    assert refused.value.field == "erase"
    assert registry.list(subject=record.subject)[0].revoked_at is None
    outcome = service.revoke("acme", "bob", None, None, erase=False, actor="test:ops")
    assert [r.consent_id for r in outcome.revoked] == [record.consent_id] and outcome.erasure is None

"""The consent admin API over real HTTP: auth, OpenAI-style errors, grant/revoke/erase/list."""

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from specloop.consent.admin_api import build_admin_router
from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.consent.settings import ConsentConfig
from specloop.consent.tenants import TenantDirectory
from specloop.storage.erasure import erase_subject

ADMIN_TOKEN = "adm1n-tok3n-for-tests-9f8e7d6c5b4a3210"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def client(registry: ConsentRegistry, config: ConsentConfig,
           tenants: TenantDirectory) -> Iterator[TestClient]:
    assert config.admin_token == ADMIN_TOKEN
    app = FastAPI()
    app.include_router(build_admin_router(registry, config, tenants, erase_subject), prefix="/admin")
    with TestClient(app) as c:
        yield c


def assert_error(response: object, status: int, param: str | None, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "missing_admin_token"),
        ({"Authorization": "Basic abc"}, 401, "missing_admin_token"),
        ({"Authorization": "Bearer "}, 401, "missing_admin_token"),
        ({"Authorization": "Bearer wrong-token"}, 403, "invalid_admin_token"),
        ({"Authorization": f"Bearer {ADMIN_TOKEN}x"}, 403, "invalid_admin_token"),
    ],
)
def test_auth_required_before_body_is_read(client: TestClient, headers: dict, status: int,
                                           code: str) -> None:
    for method, url, body in [("POST", "/admin/consents", "{not json"),
                              ("POST", "/admin/consents/revoke", "{}"),
                              ("GET", "/admin/consents", None)]:
        response = client.request(method, url, content=body, headers=headers)
        assert_error(response, status, None, code)


def test_grant_list_revoke(client: TestClient, registry: ConsentRegistry,
                           pseudonymizer: Pseudonymizer, config: ConsentConfig) -> None:
    response = client.post("/admin/consents", headers=AUTH, json={
        "tenant": "acme", "user": "alice", "expires_at": "2099-01-01T00:00:00Z"})
    assert response.status_code == 201, response.text
    granted = response.json()
    subject = pseudonymizer.subject("acme", "alice")
    assert granted["subject"] == subject
    assert (granted["purpose"], granted["policy_version"]) == ("drafter_training", "2025-06")
    assert granted["expires_at"] == "2099-01-01T00:00:00+00:00"
    assert registry.list(subject=subject)[0].consent_id == granted["consent_id"]

    listed = client.get("/admin/consents", headers=AUTH, params={"tenant": "acme"}).json()
    assert [r["consent_id"] for r in listed["data"]] == [granted["consent_id"]]
    queried = client.post("/admin/consents/query", headers=AUTH,
                          json={"tenant": "acme", "user": "alice"}).json()
    assert queried == listed

    revoked = client.post("/admin/consents/revoke", headers=AUTH,
                          json={"tenant": "acme", "subject": subject}).json()
    assert revoked["erasure"] is None
    assert revoked["revoked"][0]["revoked_at"] is not None
    events = [json.loads(x)["event"] for x in config.audit_log_path.read_text().splitlines()]
    assert events == ["grant", "revoke"]
    assert "alice" not in config.audit_log_path.read_text()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"user": "alice"}, "tenant"),
        ({"tenant": "acme"}, "user"),
        ({"tenant": "acme", "user": "a", "subject": "1" * 64}, "user"),
        ({"tenant": "acme", "subject": "alice"}, "subject"),
        ({"tenant": "nope", "user": "alice"}, "tenant"),
        ({"tenant": "initech", "user": "alice"}, "policy_version"),
        ({"tenant": "acme", "user": "alice", "expires_at": "2099-01-01T00:00:00"}, "expires_at"),
        ({"tenant": "acme", "user": "alice", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"tenant": "acme", "user": "alice", "purpose": "Bad Purpose"}, "purpose"),
        ({"tenant": "acme", "user": "alice", "colour": "red"}, "colour"),
        ({"tenant": 5, "user": "alice"}, "tenant"),
    ],
)
def test_bad_grant_is_400_naming_the_field(client: TestClient, body: dict, param: str) -> None:
    assert_error(client.post("/admin/consents", headers=AUTH, json=body), 400, param,
                 "invalid_value")


def test_malformed_json_is_400(client: TestClient) -> None:
    headers = AUTH | {"Content-Type": "application/json"}
    response = client.post("/admin/consents", headers=headers, content="{not json")
    assert_error(response, 400, None, "invalid_json")
    assert "not valid JSON" in response.json()["error"]["message"]


def test_revoke_with_erase(client: TestClient, pseudonymizer: Pseudonymizer,
                           write_traces: Callable[[list[tuple[str, str]], int], Path],
                           subject_rows: Callable[[str, str], int]) -> None:
    pytest.importorskip("specloop.storage.erasure")
    subject = pseudonymizer.subject("acme", "bob")
    client.post("/admin/consents", headers=AUTH, json={"tenant": "acme", "user": "bob"})
    write_traces([("acme", subject), ("acme", "f" * 64)], 0)
    response = client.post("/admin/consents/revoke", headers=AUTH,
                           json={"tenant": "acme", "user": "bob", "erase": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["erasure"]["erasure"]["rows_removed"] == 1
    assert len(body["revoked"]) == 1
    assert subject_rows("acme", subject) == 0
    assert subject_rows("acme", "f" * 64) == 1


ACME_ADMIN = "acme-own-admin-token-6c1d0e2f9a"


@pytest.fixture
def scoped_client(registry: ConsentRegistry, config: ConsentConfig, tmp_path: Path) -> Iterator[TestClient]:
    """Two capturing tenants; acme holds its own admin token."""
    import hashlib

    path = tmp_path / "tenants.yaml"
    path.write_text(f"""
tenants:
  - name: acme
    api_keys: [acme-api-key-0123456789abcdef]
    admin_token_sha256: [{hashlib.sha256(ACME_ADMIN.encode()).hexdigest()}]
    capture_allowed: true
    policy_version: "2025-06"
  - name: globex
    api_keys: [globex-api-key-0123456789]
    capture_allowed: true
    policy_version: "2025-06"
""")
    app = FastAPI()
    app.include_router(build_admin_router(registry, config, TenantDirectory.load(path), erase_subject), prefix="/admin")
    with TestClient(app) as c:
        yield c


def test_a_tenant_admin_token_acts_for_its_tenant_only(scoped_client: TestClient) -> None:
    own = {"Authorization": f"Bearer {ACME_ADMIN}"}
    assert scoped_client.post("/admin/consents", json={"tenant": "acme", "user": "u1"}, headers=own).status_code == 201
    granted = scoped_client.post("/admin/consents", json={"tenant": "globex", "user": "u2"}, headers=AUTH)
    assert granted.status_code == 201
    for method, url, body in [("POST", "/admin/consents", {"tenant": "globex", "user": "u3"}),
                              ("POST", "/admin/consents/revoke", {"tenant": "globex", "user": "u2", "erase": True}),
                              ("POST", "/admin/consents/query", {"tenant": "globex"}),
                              ("GET", "/admin/consents?tenant=globex", None)]:
        assert_error(scoped_client.request(method, url, json=body, headers=own), 403, "tenant",
                     "admin_token_out_of_scope")
    # A listing without a tenant is its own tenant's; the deployment's token still sees both.
    assert {r["tenant"] for r in scoped_client.get("/admin/consents", headers=own).json()["data"]} == {"acme"}
    every = scoped_client.get("/admin/consents", headers=AUTH).json()["data"]
    assert {r["tenant"] for r in every} == {"acme", "globex"}
    revoked = scoped_client.post("/admin/consents/revoke", json={"tenant": "acme", "user": "u1"}, headers=own)
    assert revoked.status_code == 200 and len(revoked.json()["revoked"]) == 1


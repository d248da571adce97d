"""`POST /admin/drafter/reload` over HTTP: the admin token is required, bad bodies are 4xx (never 5xx),
and a good call reports what the look at the registry did."""

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.server.drafter_admin import build_drafter_admin_router
from specloop.engine.server.drafter_follower import DrafterFollower
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.broker import free_port
from specloop.storage.registry import CHAMPION, DrafterRegistry
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(120)

TOKEN = "drafter-admin-token-for-tests-0123456789"
FINGERPRINT = "4444444444444444"


@pytest.fixture
def app(tmp_path: Path) -> Iterator[tuple[TestClient, DrafterRegistry, LLMEngine]]:
    target = tiny_target()
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4))
    engine.start()
    follower = DrafterFollower(registry, engine, target, FINGERPRINT, "combined", [1, 2, 3, 4], tmp_path / "cache",
                               poll_s=60)
    api = FastAPI()
    api.include_router(build_drafter_admin_router(follower, TOKEN), prefix="/admin")
    try:
        with TestClient(api, raise_server_exceptions=False) as client:
            yield client, registry, engine
    finally:
        engine.stop()


def test_the_admin_token_is_required(app) -> None:
    client, _, _ = app
    missing = client.post("/admin/drafter/reload")
    wrong = client.post("/admin/drafter/reload", headers={"Authorization": "Bearer not-the-token"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_admin_token")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (403, "invalid_admin_token")


def test_reload_swaps_to_the_champion_then_reports_no_change(app, tmp_path: Path) -> None:
    client, registry, engine = app
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert client.post("/admin/drafter/reload", headers=auth).json()["result"] == "no_champion"
    artifact = save_drafter(tmp_path / "d", tiny_drafter(tiny_target()), FINGERPRINT, Lineage("d", 1, 0))
    version = registry.register(artifact, FINGERPRINT)
    registry.set_alias(FINGERPRINT, CHAMPION, version.version)

    swapped = client.post("/admin/drafter/reload", headers=auth, json={})

    assert swapped.status_code == 200
    assert swapped.json() == {"result": "swapped", "serving": "v1", "champion": "v1", "reason": None,
                              "detail": None}
    assert engine.drafter_version == "v1"
    assert client.post("/admin/drafter/reload", headers=auth).json()["result"] == "unchanged"


def test_an_unreachable_registry_is_a_503_and_serving_goes_on(tmp_path: Path) -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4))
    follower = DrafterFollower(DrafterRegistry(f"http://127.0.0.1:{free_port()}", timeout_s=1), engine, target,
                               FINGERPRINT, "combined", [1, 2, 3], tmp_path / "cache", poll_s=60)
    api = FastAPI()
    api.include_router(build_drafter_admin_router(follower, TOKEN), prefix="/admin")
    with TestClient(api) as client:
        r = client.post("/admin/drafter/reload", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 503 and r.json()["result"] == "unavailable"


BAD_BODIES = [b"{", b"[]", b'{"version": "2"}', b'"reload"', b"42", b"\xff\xfe\x00", b'{"a": [1, {"b": null}]}']


def test_bad_bodies_are_4xx_never_5xx(app) -> None:
    client, _, _ = app
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    rng = random.Random(0)
    fuzzed = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(60)]
    for body in BAD_BODIES + fuzzed:
        r = client.post("/admin/drafter/reload", content=body, headers=auth)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert r.json()["error"]["code"], body

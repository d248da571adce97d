"""Engines told of a moved or benched champion (`daemon/retrain/engine_notice.py`), over real HTTP: a
real engine with its drafter follower and admin route under uvicorn, polling only once an hour, and a
real MLflow registry (SQLite) whose alias moves reach it through the notice."""

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter

from specloop.consent.settings import ConsentSettings
from specloop.daemon.retrain.engine_notice import EngineNotice
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.server.drafter_admin import build_drafter_admin_router
from specloop.engine.server.drafter_follower import DrafterFollower
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.broker import free_port
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.dflash_helpers import tiny_drafter, tiny_target
from tests.server_thread import serve_in_thread

pytestmark = pytest.mark.timeout(120)

TOKEN = "engine-notice-admin-token-0123456789abc"
FINGERPRINT = "5555555555555555"


def counter() -> Counter:
    return Counter("notices", "test", ["result"], registry=CollectorRegistry())


def count(c: Counter, result: str) -> float:
    return c.labels(result)._value.get()


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, DrafterRegistry, LLMEngine]]:
    """An engine whose follower polls hourly, behind a real HTTP server; its URL, registry and engine."""
    target = tiny_target()
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4))
    engine.start()
    follower = DrafterFollower(registry, engine, target, FINGERPRINT, DEFAULT_LEARNED_KIND, [1, 2, 3, 4],
                               tmp_path / "cache", poll_s=3600)
    api = FastAPI()
    api.include_router(build_drafter_admin_router(follower, TOKEN), prefix="/admin")
    try:
        with serve_in_thread(api) as url:
            yield url, registry, engine
    finally:
        engine.stop()


def register(registry: DrafterRegistry, tmp_path: Path, seed: int) -> str:
    drafter = tiny_drafter(tiny_target(), seed=seed)
    return registry.register(save_drafter(tmp_path / f"d{seed}", drafter, FINGERPRINT, Lineage("d", 1, seed)),
                             FINGERPRINT).version


def test_a_moved_champion_reaches_the_engine_at_once_not_at_its_poll(served, tmp_path: Path) -> None:
    url, registry, engine = served
    first, second = register(registry, tmp_path, 1), register(registry, tmp_path, 2)
    told = counter()
    notice = EngineNotice([url], lambda: TOKEN, told)
    registry.on_serving_change = notice
    try:
        registry.set_alias(FINGERPRINT, CHAMPION, first)
        wait_for(lambda: engine.drafter_version == f"v{first}")
        registry.set_alias(FINGERPRINT, CHAMPION, second)  # a promotion
        wait_for(lambda: engine.drafter_version == f"v{second}")
        registry.set_tags(FINGERPRINT, second, {Tag.BENCHED: "true"})  # a contest benched it
        wait_for(lambda: engine.drafter_version is None)
        wait_for(lambda: count(told, "answered") >= 3)
    finally:
        notice.close()
    assert count(told, "refused") == count(told, "unreached") == 0


def test_a_notice_that_cannot_be_delivered_is_counted_and_never_raised(served, tmp_path: Path) -> None:
    url, registry, engine = served
    version = register(registry, tmp_path, 1)
    told = counter()
    notice = EngineNotice([url, f"http://127.0.0.1:{free_port()}"], lambda: "not-the-admin-token-" + "x" * 20, told)
    registry.on_serving_change = notice
    try:
        registry.set_alias(FINGERPRINT, CHAMPION, version)  # the alias moves all the same
        wait_for(lambda: count(told, "refused") == 1 and count(told, "unreached") == 1)
    finally:
        notice.close()
    assert registry.champion(FINGERPRINT).version == version
    assert engine.drafter_version is None  # its next poll (an hour away) would swap


def test_without_a_token_no_engine_is_asked(tmp_path: Path) -> None:
    told = counter()
    notice = EngineNotice(["http://127.0.0.1:9"], ConsentSettings(data_dir=tmp_path).existing_admin_token, told)
    try:
        notice(FINGERPRINT)
        wait_for(lambda: count(told, "no_token") == 1)
    finally:
        notice.close()
    assert not (tmp_path / "consent-secrets.json").exists()  # never created by the daemon


def test_the_token_is_the_one_engines_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECLOOP_ADMIN_TOKEN", raising=False)
    engines = ConsentSettings(data_dir=tmp_path).resolve().admin_token  # an engine starts: the file is made
    assert ConsentSettings(data_dir=tmp_path).existing_admin_token() == engines
    monkeypatch.setenv("SPECLOOP_ADMIN_TOKEN", TOKEN)
    assert ConsentSettings(data_dir=tmp_path).existing_admin_token() == TOKEN


def test_an_engine_that_could_not_read_the_registry_is_asked_again() -> None:
    """A stand-in engine (the retry is the notice's own logic) that answers 503, as one whose registry
    read failed does, twice before it answers."""
    asked: list[int] = []
    api = FastAPI()

    @api.post("/admin/drafter/reload")
    def reload() -> JSONResponse:
        asked.append(1)
        return JSONResponse({"result": "unavailable" if len(asked) < 3 else "swapped"},
                            status_code=503 if len(asked) < 3 else 200)

    told = counter()
    with serve_in_thread(api) as url:
        notice = EngineNotice([url], lambda: TOKEN, told, retry_s=(0.05, 0.05, 0.05))
        try:
            notice(FINGERPRINT)
            wait_for(lambda: count(told, "answered") == 1)
        finally:
            notice.close()
    assert len(asked) == 3 and count(told, "refused") == 0

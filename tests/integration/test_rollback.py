"""Rollback by the daemon itself, on the real SmolLM2: the shipped drafter serves as champion v1,
a deliberately bad drafter (the same architecture with random weights) is promoted as v2, the
engine swaps to it, its live τ read from the engine's /metrics falls, and the daemon's watch moves
`champion` back to v1 and records why; the engine swaps back."""

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Self

import httpx
import pytest
import torch

from specloop.daemon.retrain import promotion
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.live_tau import LiveTau
from specloop.daemon.retrain.policy import Rollout
from specloop.daemon.retrain.rollback import RolloutDecision, RolloutVerdict
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.retrain.watch import Watch
from specloop.daemon.shipped_drafters import SHIPPED, shipped_drafters
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.server.settings import ServerSettings
from specloop.engine.speculation.drafter_artifact import load_drafter, read_meta, save_drafter
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.integration.conftest import consent_settings, serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash map is.",
           "List three prime numbers and say why they are prime.", "Write a haiku about the sea."]


def bad_copy(good: Path, fingerprint: str, out: Path) -> Path:
    """The shipped drafter's architecture with random weights: it drafts, and is almost never right."""
    art = load_drafter(good, fingerprint)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in art.drafter.parameters():
            p.normal_(0, 0.02)
    return save_drafter(out, art.drafter, fingerprint, art.lineage)


class Traffic:
    """One client sending greedy requests back to back until stopped; counts failures."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.failures, self.done = url, model, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            body = {"model": self.model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": 32, "temperature": 0}
            i += 1
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
            if r.status_code != 200:
                self.failures.append(r.text)
            self.done += 1


def serving_version(url: str) -> str | None:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"]


def wait_until(check: Callable[[], object], timeout: float, step: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)
    return value


def test_a_bad_champion_is_rolled_back_by_the_daemon(smollm2: LoadedModel, tmp_path: Path) -> None:
    fp = smollm2.fingerprint
    good = shipped_drafters(SHIPPED)[fp]
    assert read_meta(good)["base_model_fingerprint"] == fp
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    v1 = registry.register(good, fp)
    v2 = registry.register(bad_copy(good, fp, tmp_path / "bad"), fp)
    registry.set_alias(fp, CHAMPION, v1.version)
    db = open_state(f"sqlite:///{tmp_path / 'state.db'}")
    history, live = PromotionHistory(db), LiveTau(db)
    settings = ServerSettings(max_len=512, num_slots=2, dtype="float32", device="cpu", registry=registry.tracking_uri,
                              registry_poll_s=0.5, proposer="dflash", drafter_cache_dir=tmp_path / "cache")
    rollout = Rollout(watch_minutes=10, min_verify_steps=40, rollback_below=0.9)
    with serving(smollm2, settings, consent_settings(tmp_path / "data", None)) as (url, _):
        watch = Watch(fp, registry, history, live, rollout, [url])
        wait_until(lambda: serving_version(url) == "v1", 60)
        with Traffic(url, smollm2.name) as traffic:
            def steps(label: str) -> int:
                watch.scrape_engines()
                window = live.tau(label, *_window())
                return 0 if window is None else window.drafts

            wait_until(lambda: steps("v1") >= rollout.min_verify_steps, 180)
            promotion.promote(registry, history, registry.version(fp, v2.version), "test: a bad drafter")
            wait_until(lambda: serving_version(url) == "v2", 60)
            verdict = wait_until(lambda: _rolled_back(watch), 240)
            wait_until(lambda: serving_version(url) == "v1", 60)
    assert traffic.failures == [] and traffic.done > 0
    assert registry.champion(fp).version == v1.version
    assert verdict.verdict is RolloutVerdict.ROLL_BACK and verdict.new.tau < 0.9 * verdict.baseline.tau
    event = history.last(fp)
    assert (event.action, event.version, event.previous) == (Action.ROLLED_BACK, "v2", "v1")
    assert "roll back: v2 τ" in event.reason and "vs v1 τ" in event.reason
    assert registry.version(fp, v2.version).tags[Tag.ROLLED_BACK] == event.reason


def _window() -> tuple[datetime, datetime]:
    now = datetime.now(UTC)
    return now - timedelta(minutes=30), now


def _rolled_back(watch: Watch) -> RolloutDecision | None:
    watch()
    verdict = watch.last_verdict
    return verdict if verdict is not None and verdict.verdict is RolloutVerdict.ROLL_BACK else None

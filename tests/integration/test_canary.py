"""The canary on the real SmolLM2: the shipped drafter serves as champion v1, then a copy whose
weights were zeroed after its canary τ was measured (the way weights get lost between training and
serving) is promoted as v2. The engine swaps it in, runs the probes, finds it drafting far worse than
its tag says, swaps v1 back at once and exports the failure; the daemon's watch reads it and moves
`champion` back, recording why, before any live-τ window could have judged it."""

from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specloop.daemon.evaluation.canary import canary_tau, probe_answers
from specloop.daemon.retrain import promotion
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.live_tau import LiveTau
from specloop.daemon.retrain.policy import Rollout
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.retrain.watch import Watch
from specloop.daemon.shipped_drafters import SHIPPED, shipped_drafters
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.server.settings import ServerSettings
from specloop.engine.speculation.canary import MIN_RATIO
from specloop.engine.speculation.drafter_artifact import load_drafter, save_drafter
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.integration.conftest import consent_settings, serving
from tests.integration.test_rollback import serving_version, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def zeroed_copy(good: Path, fingerprint: str, out: Path) -> Path:
    art = load_drafter(good, fingerprint)
    with torch.no_grad():
        for p in art.drafter.parameters():
            p.zero_()
    return save_drafter(out, art.drafter, fingerprint, art.lineage)


def canary_results(url: str) -> dict[tuple[str, str], float]:
    """(version, result) -> live τ, from the engine's `/metrics`."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.labels["drafter_version"], s.labels["result"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "specloop_drafter_canary_tau"}


def test_zeroed_weights_are_caught_by_the_canary_swapped_back_and_rolled_back(smollm2: LoadedModel,
                                                                              tmp_path: Path) -> None:
    fp = smollm2.fingerprint
    good = shipped_drafters(SHIPPED)[fp]
    tau = canary_tau(smollm2, good, probe_answers(smollm2))
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    v1 = registry.register(good, fp, {Tag.TAU_CANARY: f"{tau:.6f}"})
    v2 = registry.register(zeroed_copy(good, fp, tmp_path / "zeroed"), fp, {Tag.TAU_CANARY: f"{tau:.6f}"})
    registry.set_alias(fp, CHAMPION, v1.version)
    db = open_state(f"sqlite:///{tmp_path / 'state.db'}")
    history = PromotionHistory(db)
    settings = ServerSettings(max_len=512, num_slots=8, dtype="float32", device="cpu", registry=registry.tracking_uri,
                              registry_poll_s=0.5, proposer="dflash+suffix", drafter_cache_dir=tmp_path / "cache")
    # A window no live τ could fill in this test: only the canary can roll v2 back.
    rollout = Rollout(watch_minutes=60, min_verify_steps=100_000, rollback_below=0.9)
    with serving(smollm2, settings, consent_settings(tmp_path / "data", None)) as (url, _):
        watch = Watch(fp, registry, history, LiveTau(db), rollout, [url])
        wait_until(lambda: ("v1", "pass") in canary_results(url), 120)
        assert canary_results(url)[("v1", "pass")] >= MIN_RATIO * tau  # serving drafts as the replay measured
        promotion.promote(registry, history, registry.version(fp, v2.version), "test: weights lost after the canary")
        failed = wait_until(lambda: canary_results(url).get(("v2", "fail")), 120)
        assert failed < MIN_RATIO * tau
        # The engine swaps back on its own, before the daemon moves; the failed canary is counted just
        # before the swap, so a busy machine can read the metric while v2 still serves.
        wait_until(lambda: serving_version(url) == "v1", 60)
        watch()
    assert registry.champion(fp).version == v1.version
    event = history.last(fp)
    assert (event.action, event.version, event.previous) == (Action.ROLLED_BACK, "v2", "v1")
    assert event.reason.startswith(f"canary failed on engine {url}: live τ {failed:.3f}")
    assert registry.version(fp, v2.version).tags[Tag.ROLLED_BACK] == event.reason

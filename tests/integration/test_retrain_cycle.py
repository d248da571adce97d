"""One whole retraining cycle with real parts: the tiny 6-layer model served with capture through
the real tansu broker and sink, consent granted through the admin API, real MLflow (SQLite, local
artifacts), and the retraining daemon's tick: traces → run → a version with every tag → `champion`
moved → the engine serving the new version, with streaming clients running throughout and none of
their requests failing."""

import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from specloop.daemon.retrain.policy import parse_policy
from specloop.daemon.retrain.run_log import RunOutcome
from specloop.daemon.retrain.service import RetrainDaemon
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.storage.broker import EmbeddedBroker
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.integration.conftest import ACME_KEY, registry_wiring, running_sink, serving
from tests.integration.test_capture_pipeline import _rows
from tests.integration.test_drafter_swap import Clients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

POLICY = """
schedule: {interval_minutes: 60}
triggers: {min_new_traces: 30}
data: {min_traces: 20}
training: {max_steps: 12, max_minutes: 2, batch_size: 2, anchors: 8}
evaluation: {heldout_fraction: 0.25, min_heldout: 4}
gate: {min_relative_gain: -1.0}  # any challenger: this tests the plumbing, not the drafter
cooldown_minutes: 0
"""
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def useless_drafter(loaded: LoadedModel, path: Path) -> Path:
    """Champion v1: a drafter whose only output token never appears in answers, so it is never
    accepted, and any challenger warm-started from it (with the answers' tokens added) can only do
    as well or better where n-gram lookup does not draft."""
    config = DFlashConfig.for_target(loaded.model.config, 2, num_taps=3, block_size=4)
    # Output vocabulary [0]: <|endoftext|>, the tiny model's pad token, which it never generates.
    drafter = DFlashDrafter(replace(config, output_vocab_size=1)).eval()
    return save_drafter(path, drafter, loaded.fingerprint, Lineage("sha256:useless", 0, 0, {}))


def test_traces_to_a_promoted_drafter_the_engine_serves(broker: EmbeddedBroker, deep_loaded: LoadedModel,
                                                        tmp_path: Path) -> None:
    fp = deep_loaded.fingerprint
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'registry' / 'mlflow.db'}", tmp_path / "registry" / "art")
    v1 = registry.register(useless_drafter(deep_loaded, tmp_path / "v1"), fp)
    registry.set_alias(fp, CHAMPION, v1.version)
    wiring = registry_wiring(broker, tmp_path, registry.tracking_uri, poll_s=0.5)
    consent, resolved, sink, settings, admin = (wiring.consent, wiring.resolved, wiring.sink, wiring.settings,
                                                wiring.admin)
    with running_sink(sink), serving(deep_loaded, settings, consent) as (url, _):
        for user in ("u1", "swap-user"):
            assert httpx.post(f"{url}/admin/consents", json={"tenant": "acme", "user": user},
                              headers=admin).status_code == 201
        prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(i % 5 + 3)) + f" {i}" for i in range(48)]
        for text in prompts:
            body = {"model": deep_loaded.name, "messages": [{"role": "user", "content": text}], "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True, "user": "u1"}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {ACME_KEY}"},
                           timeout=60)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while len(_rows(resolved.traces_root)) < len(prompts):
            assert time.monotonic() < deadline, "traces did not reach Parquet"
            time.sleep(0.3)

        daemon_settings = DaemonSettings(
            policy=tmp_path / "unused.yaml", registry=registry.tracking_uri, traces_root=resolved.traces_root,
            consent_db=resolved.registry_path, state_db=f"sqlite:///{tmp_path / 'state.db'}",
            work_dir=tmp_path / "runs", engines=[url])
        daemon = RetrainDaemon(daemon_settings, parse_policy(POLICY), deep_loaded, registry)
        with Clients(url, deep_loaded.name, count=3) as clients:
            report = daemon.tick()
            run = daemon.loop.runs.runs()[-1]
            assert report.decision.train and run.outcome is RunOutcome.PROMOTED, run.detail
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"] != "v2":
                assert time.monotonic() < deadline, "the engine did not swap to v2"
                time.sleep(0.2)
            swapped_at = time.monotonic()
            time.sleep(2.0)
        metrics = httpx.get(f"{url}/metrics").text

    assert clients.failures == []
    assert sum(c["started"] > swapped_at for c in clients.done) >= 2
    v2 = registry.champion(fp)
    assert v2.version == "2" and v2.tags[Tag.PREVIOUS_CHAMPION] == v1.version
    for tag in (Tag.TAU_CHALLENGER, Tag.TAU_CHAMPION, Tag.EVAL_SET, Tag.DATASET, Tag.GATE, Tag.GATE_REASON, Tag.RUN):
        assert v2.tags.get(tag), tag
    assert v2.tau_challenger >= v2.tau_champion
    assert 'specloop_drafter_serving{drafter_version="v2"} 1.0' in metrics
    assert 'specloop_spec_decode_num_drafts_total{drafter_version="v2"}' in metrics

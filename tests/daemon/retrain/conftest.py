"""A retraining loop on a tiny random Llama, with real parts: consented traces in the trace
store's Parquet layout, a real consent registry, a real MLflow registry (SQLite, local artifacts)
and the daemon's own SQLite state database. `make_loop(policy_yaml)` builds a `Loop` over them."""

import json
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from specloop.consent.registry import ConsentRegistry
from specloop.daemon.retrain.history import PromotionHistory
from specloop.daemon.retrain.policy import parse_policy
from specloop.daemon.retrain.run import Loop
from specloop.daemon.retrain.run_log import RunLog
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.retrain.state_db import open_state
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.storage.layout import hive_dir, sink_file_name, write_parquet_atomic
from specloop.storage.registry import CHAMPION, DrafterRegistry
from specloop.storage.schema import Trace, TraceSampling, TraceSpecStats, to_arrow, trace_day
from tests.dflash_helpers import greedy_outputs, tiny_drafter

TENANT = "acme"
SUBJECT = "c" * 64
FAST_POLICY = """
schedule: {interval_minutes: 1}
triggers: {min_new_traces: 10, first_drafter: false}
data: {min_traces: 10, first_drafter_prompts: 0}  # tests of a first drafter turn both on
training: {max_steps: 12, max_minutes: 2, batch_size: 2, anchors: 8, block_size: 4}
evaluation: {heldout_fraction: 0.25, min_heldout: 4}
gate: {min_relative_gain: -1.0}  # any challenger: random tiny drafters lose to suffix decoding alone
cooldown_minutes: 0
"""


def store_traces(root: Path, loaded: LoadedModel, consent_id: str, count: int, seed: int = 0,
                 created_at: datetime | None = None, base_model: str | None = None) -> None:
    """`count` traces whose responses are the target's greedy answers, as the sink stores them
    (stamped with `base_model` instead of the target's fingerprint when given)."""
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size
    prompts = [tuple(rng.randrange(vocab) for _ in range(rng.randrange(6, 14))) for _ in range(count)]
    at = created_at or datetime.now(UTC)  # after the consent was granted, before the run starts
    fingerprint = base_model or loaded.fingerprint
    traces = [_trace(s.prompt, s.response, fingerprint, consent_id, at) for s in
              greedy_outputs(loaded.model, prompts, max_tokens=24)]
    write_parquet_atomic(hive_dir(root, fingerprint, trace_day(traces[0])) /
                         sink_file_name("traces", 0, seed * 100_000), to_arrow(traces))


def _trace(prompt: tuple[int, ...], response: tuple[int, ...], base_model: str, consent_id: str,
           at: datetime) -> Trace:
    return Trace(
        trace_id=uuid.uuid4().hex, created_at=at, finished_at=at + timedelta(milliseconds=200), tenant=TENANT,
        subject=SUBJECT, consent_id=consent_id, consent_policy_version="2026-01", base_model=base_model,
        drafter_version=None, endpoint="/v1/chat/completions",
        sampling=TraceSampling(temperature=0.0, top_p=1.0, top_k=0, max_tokens=24, seed=None),
        prompt_token_ids=list(prompt), response_token_ids=list(response), prompt_text=None, response_text=None,
        spec=TraceSpecStats(drafts=0, draft_tokens=0, accepted_tokens=0), finish_reason="length")


@pytest.fixture
def consent_id(tmp_path: Path) -> str:
    registry = ConsentRegistry(tmp_path / "consent.db")
    try:
        return registry.grant(TENANT, SUBJECT, "drafter_training", "2026-01", "test").consent_id
    finally:
        registry.close()


@pytest.fixture
def make_loop(tmp_path: Path, deep_loaded: LoadedModel) -> Callable[..., Loop]:
    def make(policy_yaml: str = FAST_POLICY, registry: DrafterRegistry | None = None,
             target: LoadedModel | None = None) -> Loop:
        policy_file = tmp_path / "policy.yaml"
        policy_file.write_text(policy_yaml)
        registry_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        settings = DaemonSettings(policy=policy_file, registry=registry_uri, traces_root=tmp_path / "traces",
                                  consent_db=tmp_path / "consent.db", state_db=f"sqlite:///{tmp_path / 'state.db'}",
                                  work_dir=tmp_path / "runs")
        db = open_state(settings.state_db)
        return Loop(parse_policy(policy_yaml), settings, registry or DrafterRegistry(registry_uri),
                    target or deep_loaded, RunLog(db), PromotionHistory(db))

    return make


def first_drafter_policy(prompts: Path, count: int = 16) -> str:
    """FAST_POLICY with a first drafter made from the first `count` prompts of `prompts`."""
    return (FAST_POLICY.replace("first_drafter: false", "first_drafter: true")
            .replace("first_drafter_prompts: 0",
                     f"first_drafter_prompts: {count}, first_drafter_prompts_file: {prompts}"))


def short_prompts(path: Path, count: int = 24) -> Path:
    """`count` one-line chat prompts the tiny model (256 positions) can answer: the shipped ones are longer."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {words[i % 8]} {i}"}]}) + "\n"
                            for i in range(count)))
    return path


def seed_champion(loop: Loop, tmp_path: Path, base_model: str | None = None) -> str:
    """A random tiny drafter as champion v1 of `base_model` (default: the loop's; what a challenger
    warm-starts from); its version."""
    folder = "seed" if base_model is None else f"seed-{base_model}"
    base_model = base_model or loop.base_model
    art = save_drafter(tmp_path / folder, tiny_drafter(loop.target.model, block_size=4), base_model,
                       Lineage("sha256:seed", 0, 0, {}))
    v = loop.registry.register(art, base_model)
    loop.registry.set_alias(base_model, CHAMPION, v.version)
    return v.version

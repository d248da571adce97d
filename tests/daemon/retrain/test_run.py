"""A retraining run end to end on the tiny model with real MLflow, consent registry and Parquet:
dataset → train → contest → gate → register → promote, and each way it can end otherwise."""

import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from specloop.consent.registry import ConsentRegistry
from specloop.daemon.retrain.history import Action
from specloop.daemon.retrain.run import Loop, RetrainRun, new_run_id, resume_promotion
from specloop.daemon.retrain.run_log import RunOutcome
from specloop.engine.loaders.load import LoadedModel
from specloop.storage.dataset_copies import Lineage, read_lineage
from specloop.storage.registry import CHALLENGER, Approval, DrafterRegistry, RegistryUnavailable, Tag
from tests.daemon.retrain.conftest import (
    FAST_POLICY,
    SUBJECT,
    TENANT,
    first_drafter_policy,
    seed_champion,
    short_prompts,
    store_traces,
)

pytestmark = pytest.mark.timeout(300)


def run(loop: Loop, **kw: object) -> tuple[str, RunOutcome]:
    run_id = new_run_id()
    return run_id, RetrainRun(loop, run_id, threading.Event(), **kw).execute()


def test_a_run_registers_a_fully_tagged_version_and_promotes_it(make_loop: Callable[..., Loop], consent_id: str,
                                                                 tmp_path: Path) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    run_id, outcome = run(loop)
    record = loop.runs.runs()[-1]
    assert outcome is RunOutcome.PROMOTED, record.detail
    assert list(record.timings) == ["dataset", "champion", "train", "evaluate", "canary", "register", "promote"]
    v = loop.registry.champion(loop.base_model)
    assert v.version == "2" and record.version == "2"
    for tag in (Tag.BASE_MODEL, Tag.TAU_CHALLENGER, Tag.TAU_CHAMPION, Tag.EVAL_SET, Tag.DATASET, Tag.GATE,
                Tag.GATE_REASON, Tag.RUN, Tag.PREVIOUS_CHAMPION, Tag.TAU_CANARY):
        assert v.tags.get(tag), tag
    assert 1.0 <= float(v.tags[Tag.TAU_CANARY]) <= 16  # τ on the canary probes, for every engine to check
    assert v.tags[Tag.GATE] == "promote" and v.tags[Tag.PREVIOUS_CHAMPION] == "1" and v.tags[Tag.RUN] == run_id
    # Both drafters tagged with their speed over suffix decoding alone, which engines bench them by.
    previous = loop.registry.version(loop.base_model, "1")
    assert v.speed_over_suffix is not None and previous.speed_over_suffix is not None
    # The policy's margin is -100%: any drafter serves.
    assert v.tags[Tag.BENCHED] == previous.tags[Tag.BENCHED] == "false"
    event = loop.history.last(loop.base_model)
    assert (event.action, event.version, event.previous, event.run_id) == (Action.PROMOTED, "v2", "v1", run_id)
    # What erasure reads: the version, the dataset it trained on and the champion it started from.
    assert read_lineage(loop.settings.work_dir / run_id) == Lineage(run_id, loop.base_model, "2", "dataset", "1")
    # The MLflow run holds the params, metrics and dataset, and the version's artifact.
    client = loop.registry._client
    mlflow_run = client.get_run(v.run_id)
    assert mlflow_run.data.metrics["tau_challenger"] == pytest.approx(v.tau_challenger)
    assert {"tau_suffix", "tau_champion", "acceptance_pos0_challenger", "tokens_per_s_champion",
            "speed_gain_low"} <= set(mlflow_run.data.metrics)
    assert mlflow_run.data.params["policy.training.max_steps"] == "12"
    (dataset,) = mlflow_run.inputs.dataset_inputs
    assert v.tags[Tag.DATASET].removeprefix("sha256:").startswith(dataset.dataset.digest)
    assert mlflow_run.info.status == "FINISHED"


def test_a_challenger_below_the_gain_is_refused_and_champion_stays(make_loop: Callable[..., Loop], consent_id: str,
                                                                 tmp_path: Path) -> None:
    loop = make_loop(FAST_POLICY.replace("min_relative_gain: -1.0", "min_relative_gain: 100.0"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    _, outcome = run(loop)
    assert outcome is RunOutcome.REFUSED
    assert loop.registry.champion(loop.base_model).version == "1"
    refused = loop.registry.version(loop.base_model, "2")
    assert refused.tags[Tag.GATE] == "refuse" and "below the 10000.0% required gain" in refused.tags[Tag.GATE_REASON]
    # The seeded random champion costs a drafter pass per step for next to nothing: suffix decoding alone
    # is faster, so the challenger was judged against it and engines bench the champion.
    assert "over suffix decoding alone (v1 + suffix decoding benched)" in refused.tags[Tag.GATE_REASON]
    champion = loop.registry.version(loop.base_model, "1")
    assert champion.speed_over_suffix < 0 and champion.benched
    assert loop.history.last(loop.base_model).action is Action.REFUSED


def test_with_approval_required_it_waits_then_a_rejection_is_never_promoted(
        make_loop: Callable[..., Loop], consent_id: str, tmp_path: Path) -> None:
    from specloop.daemon.retrain.promotion import settle_approval

    loop = make_loop(FAST_POLICY.replace("min_relative_gain: -1.0", "min_relative_gain: -1.0, require_approval: true"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    _, outcome = run(loop)
    assert outcome is RunOutcome.AWAITING_APPROVAL
    waiting = loop.registry.by_alias(loop.base_model, CHALLENGER)
    assert waiting.version == "2" and waiting.approval is Approval.PENDING
    assert settle_approval(loop.registry, loop.history, loop.base_model) is None  # still pending
    assert loop.registry.champion(loop.base_model).version == "1"
    loop.registry.set_tags(loop.base_model, "2", {Tag.APPROVAL: Approval.REJECTED})
    assert settle_approval(loop.registry, loop.history, loop.base_model).action is Action.REJECTED
    assert loop.registry.champion(loop.base_model).version == "1"
    assert loop.registry.by_alias(loop.base_model, CHALLENGER) is None
    assert settle_approval(loop.registry, loop.history, loop.base_model) is None


def test_an_approved_challenger_is_promoted(make_loop: Callable[..., Loop], consent_id: str, tmp_path: Path) -> None:
    from specloop.daemon.retrain.promotion import settle_approval

    loop = make_loop(FAST_POLICY.replace("min_relative_gain: -1.0", "min_relative_gain: -1.0, require_approval: true"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    run(loop)
    loop.registry.set_tags(loop.base_model, "2", {Tag.APPROVAL: Approval.APPROVED})
    event = settle_approval(loop.registry, loop.history, loop.base_model)
    assert (event.action, event.version, event.previous, event.actor) == (Action.PROMOTED, "v2", "v1", "approval")
    assert loop.registry.champion(loop.base_model).version == "2"


def test_without_a_champion_the_challenger_must_beat_suffix_decoding_alone(make_loop: Callable[..., Loop],
                                                                 consent_id: str) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    run(loop)
    v = loop.registry.version(loop.base_model, "1")
    assert "over suffix decoding alone" in v.tags[Tag.GATE_REASON]
    mlflow_run = loop.registry._client.get_run(v.run_id)
    assert float(v.tags[Tag.TAU_CHAMPION]) == pytest.approx(mlflow_run.data.metrics["tau_suffix"])
    speed = mlflow_run.data.metrics
    assert speed["speed_gain"] == pytest.approx(speed["tokens_per_s_challenger"] / speed["tokens_per_s_suffix"] - 1)
    assert speed["speed_gain_low"] <= speed["speed_gain"] <= speed["speed_gain_high"]
    assert v.speed_over_suffix == pytest.approx(speed["speed_over_suffix_challenger"])


def test_too_few_traces_skips_without_training(make_loop: Callable[..., Loop], consent_id: str) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 6)
    _, outcome = run(loop)
    record = loop.runs.runs()[-1]
    assert outcome is RunOutcome.SKIPPED and "the policy needs 10" in record.detail
    assert loop.registry.versions(loop.base_model) == []


def test_no_traces_at_all_skips(make_loop: Callable[..., Loop]) -> None:
    _, outcome = run(make_loop())
    assert outcome is RunOutcome.SKIPPED


def test_mlflow_down_fails_the_run_cleanly(make_loop: Callable[..., Loop], consent_id: str) -> None:
    dead = DrafterRegistry("http://127.0.0.1:9", timeout_s=1)  # nothing listens on the discard port
    loop = make_loop(registry=dead)
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    _, outcome = run(loop)
    record = loop.runs.runs()[-1]
    assert outcome is RunOutcome.FAILED and record.detail.startswith("MLflow"), record.detail
    assert loop.history.events() == []


def test_a_stop_during_training_abandons_the_run_and_registers_nothing(make_loop: Callable[..., Loop],
                                                                       consent_id: str) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    _, outcome = run(loop, should_stop=lambda: "lease lost")
    record = loop.runs.runs()[-1]
    assert outcome is RunOutcome.ABANDONED and "lease lost" in record.detail and record.step == "train"
    assert loop.registry.versions(loop.base_model) == []


def _revoke(loop: Loop) -> None:
    consent = ConsentRegistry(loop.settings.consent_db)
    try:
        assert consent.revoke(TENANT, SUBJECT)
    finally:
        consent.close()


def test_consent_revoked_during_training_stops_the_run_before_it_registers(make_loop: Callable[..., Loop],
                                                                          consent_id: str, tmp_path: Path) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    revoked = []

    def revoke_once() -> None:  # the trainer asks whether to stop between steps: a revocation lands meanwhile
        if not revoked:
            _revoke(loop)
            revoked.append(True)

    _, outcome = run(loop, should_stop=revoke_once)
    record = loop.runs.runs()[-1]
    assert revoked and outcome is RunOutcome.CONSENT_WITHDRAWN, record.detail
    assert "1 of 1 consents no longer in force" in record.detail and record.step == "register"
    assert [v.version for v in loop.registry.versions(loop.base_model)] == ["1"]
    assert loop.registry.champion(loop.base_model).version == "1"


def test_an_erasure_during_training_stops_the_run_though_it_scrubbed_the_dataset(
        make_loop: Callable[..., Loop], consent_id: str, tmp_path: Path) -> None:
    from specloop.storage.erasure import erase_subject

    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    erased = []

    def erase_once() -> None:  # revocation with erasure, reaching the run's own dataset mid-training
        if not erased:
            _revoke(loop)
            erased.append(erase_subject(loop.settings.traces_root, TENANT, SUBJECT, loop.settings.work_dir))

    _, outcome = run(loop, should_stop=erase_once)
    record = loop.runs.runs()[-1]
    assert erased and erased[0].dataset_rows_removed > 0  # the files the re-check once read are scrubbed
    assert outcome is RunOutcome.CONSENT_WITHDRAWN and "erased since it was built" in record.detail, record.detail
    assert [v.version for v in loop.registry.versions(loop.base_model)] == ["1"]


def test_consent_revoked_after_registering_refuses_the_version(make_loop: Callable[..., Loop], consent_id: str,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specloop.daemon.retrain import run as run_module

    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)
    register = run_module.RetrainRun._register

    def register_then_revoke(self: RetrainRun, *args: object) -> object:
        version = register(self, *args)
        _revoke(loop)
        return version

    monkeypatch.setattr(run_module.RetrainRun, "_register", register_then_revoke)
    run_id, outcome = run(loop)
    assert outcome is RunOutcome.REFUSED
    refused = loop.registry.version(loop.base_model, "2")
    assert refused.tags[Tag.GATE] == "refuse" and "consent withdrawn" in refused.tags[Tag.GATE_REASON]
    event = loop.history.last(loop.base_model)
    assert (event.action, event.version, event.run_id) == (Action.REFUSED, "v2", run_id)
    assert "consent withdrawn" in event.reason
    assert loop.registry.champion(loop.base_model).version == "1"


def test_a_run_killed_after_registering_is_promoted_on_restart(make_loop: Callable[..., Loop], consent_id: str,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specloop.daemon.retrain import run as run_module

    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48)
    seed_champion(loop, tmp_path)

    def killed(*_: object, **__: object) -> None:
        raise SystemExit("killed")  # what dies with the process: nothing after register ran

    monkeypatch.setattr(run_module, "act_on_gate", killed)
    run_id = new_run_id()
    with pytest.raises(SystemExit):
        RetrainRun(loop, run_id, threading.Event()).execute()
    monkeypatch.undo()
    assert loop.runs.runs()[-1].outcome is RunOutcome.RUNNING and loop.runs.runs()[-1].version == "2"
    assert loop.registry.champion(loop.base_model).version == "1"
    assert resume_promotion(loop) == [run_id]
    assert loop.registry.champion(loop.base_model).version == "2"
    record = loop.runs.runs()[-1]
    assert record.outcome is RunOutcome.PROMOTED and record.detail.startswith("resumed after a restart")


def test_unfinished_runs_before_register_are_abandoned_on_restart(make_loop: Callable[..., Loop]) -> None:
    loop = make_loop()
    loop.runs.start("r-dead", loop.base_model, loop.runs.runs()[-1].started_at if loop.runs.runs() else
                    __import__("datetime").datetime.now(__import__("datetime").UTC))
    loop.runs.step("r-dead", "train", {"dataset": 1.0})
    assert resume_promotion(loop) == []
    record = loop.runs.runs()[-1]
    assert record.outcome is RunOutcome.ABANDONED and "at step train" in record.detail


def test_registry_unavailable_is_what_a_dead_server_raises() -> None:
    with pytest.raises(RegistryUnavailable):
        DrafterRegistry("http://127.0.0.1:9", timeout_s=1).champion("0" * 16)


OLD_MODEL = "0f0f0f0f0f0f0f0f"  # the fingerprint the traffic was served with before the model changed


def test_a_new_base_model_bootstraps_from_the_old_models_prompts(make_loop: Callable[..., Loop],
                                                                 consent_id: str) -> None:
    loop = make_loop()
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48, base_model=OLD_MODEL)
    run_id, outcome = run(loop)
    record = loop.runs.runs()[-1]
    assert outcome in (RunOutcome.PROMOTED, RunOutcome.REFUSED), record.detail
    (v,) = loop.registry.versions(loop.base_model)
    assert v.tags[Tag.BOOTSTRAP_FROM] == OLD_MODEL and v.base_model == loop.base_model
    assert loop.registry.versions(OLD_MODEL) == []  # the old model's registered model is untouched
    assert "over suffix decoding alone" in v.tags[Tag.GATE_REASON]


def test_no_bootstrap_when_the_policy_says_no_or_a_champion_exists(make_loop: Callable[..., Loop], consent_id: str,
                                                                   tmp_path: Path) -> None:
    loop = make_loop(FAST_POLICY.replace("data: {min_traces: 10,",
                                         "data: {min_traces: 10, bootstrap_from_other_models: false,"))
    store_traces(loop.settings.traces_root, loop.target, consent_id, 48, base_model=OLD_MODEL)
    assert run(loop)[1] is RunOutcome.SKIPPED
    with_champion = make_loop()
    seed_champion(with_champion, tmp_path)
    assert run(with_champion)[1] is RunOutcome.SKIPPED


QUANTIZED = "0a0a0a0a0a0a0a0a"  # as an NVFP4 variant of the tiny model: another fingerprint, the same shape


def test_a_first_drafter_answers_the_shipped_prompts_and_starts_from_the_source_models_champion(
        make_loop: Callable[..., Loop], deep_loaded: LoadedModel, tmp_path: Path) -> None:
    variant = replace(deep_loaded, fingerprint=QUANTIZED, source_fingerprint=deep_loaded.fingerprint)
    loop = make_loop(first_drafter_policy(short_prompts(tmp_path / "prompts.jsonl")), target=variant)
    seed_champion(loop, tmp_path, base_model=deep_loaded.fingerprint)  # no traces of any model are stored
    run_id, outcome = run(loop)
    record = loop.runs.runs()[-1]
    assert outcome is RunOutcome.PROMOTED, record.detail  # any challenger beats "no drafter" under this gate
    (v,) = loop.registry.versions(QUANTIZED)
    assert v.tags[Tag.BOOTSTRAP_FROM] == "shipped-prompts"
    assert v.tags[Tag.WARM_START_FROM] == f"{deep_loaded.fingerprint} v1"
    assert "over suffix decoding alone" in v.tags[Tag.GATE_REASON]
    # The lineage names the other base model's drafter, for erasure to follow; the prompts answered are kept.
    assert read_lineage(loop.settings.work_dir / run_id) == Lineage(run_id, QUANTIZED, "1", "shipped-prompts", "1",
                                                                    deep_loaded.fingerprint)
    assert (loop.settings.work_dir / run_id / "shipped-prompts" / "prompts.jsonl").is_file()
    (dataset,) = loop.registry._client.get_run(v.run_id).inputs.dataset_inputs
    assert dataset.dataset.name == "shipped-prompts"
    assert {t.key: t.value for t in dataset.tags}["train_rows"] == "12"  # 16 prompts, a quarter held out
    assert loop.registry.versions(deep_loaded.fingerprint)[0].tags.get(Tag.GATE) is None  # the parent is untouched


def test_a_first_drafter_is_new_when_no_other_drafter_fits_or_exists(make_loop: Callable[..., Loop],
                                                                     tmp_path: Path) -> None:
    loop = make_loop(first_drafter_policy(short_prompts(tmp_path / "prompts.jsonl")))
    run_id, outcome = run(loop)
    assert outcome is RunOutcome.PROMOTED, loop.runs.runs()[-1].detail
    (v,) = loop.registry.versions(loop.base_model)
    assert Tag.WARM_START_FROM not in v.tags and v.tags[Tag.BOOTSTRAP_FROM] == "shipped-prompts"
    assert read_lineage(loop.settings.work_dir / run_id).warm_start_from is None


def test_too_few_shipped_prompts_for_the_policy_skip_the_run(make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    loop = make_loop(first_drafter_policy(short_prompts(tmp_path / "prompts.jsonl"), count=8))  # 6 to train, 10 needed
    _, outcome = run(loop)
    assert outcome is RunOutcome.SKIPPED and loop.registry.versions(loop.base_model) == []

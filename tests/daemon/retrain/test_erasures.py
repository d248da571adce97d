"""The daemon's part of erasure, on a real MLflow registry: run datasets that still hold an erased
subject are scrubbed, and the drafter trained on them is kept, flagged or retired as the policy says."""

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from specloop.daemon.retrain import promotion
from specloop.daemon.retrain.erasures import ErasureFollowUp
from specloop.daemon.retrain.history import Action
from specloop.daemon.retrain.policy import OnErasure
from specloop.daemon.retrain.run import Loop
from specloop.storage.dataset import OUTPUT_COLUMNS
from specloop.storage.dataset_copies import Lineage, record_lineage
from specloop.storage.erasure import erase_subject
from specloop.storage.layout import hive_dir, sink_file_name, write_parquet_atomic
from specloop.storage.registry import CHALLENGER, Tag
from specloop.storage.schema import to_arrow
from tests.daemon.retrain.conftest import SUBJECT, TENANT, seed_champion
from tests.storage.traces import SUBJECT_B, make_trace


def _trained_champion(loop: Loop, tmp_path: Path) -> str:
    """v1 (never trained on traffic) then v2, trained by run-2 on SUBJECT's trace, promoted over it."""
    seed_champion(loop, tmp_path)
    v2 = loop.registry.register(tmp_path / "seed", loop.base_model)
    promotion.promote(loop.registry, loop.history, v2, "test")
    traces = [make_trace("t-subject", tenant=TENANT, subject=SUBJECT, base_model=loop.base_model),
              make_trace("t-other", tenant=TENANT, subject=SUBJECT_B, base_model=loop.base_model)]
    root = loop.settings.traces_root
    write_parquet_atomic(hive_dir(root, loop.base_model, "2025-03-01") / sink_file_name("traces", 0, 0),
                         to_arrow(traces))
    run = loop.settings.work_dir / "run-2"
    write_parquet_atomic(run / "dataset" / "train.parquet", to_arrow(traces).select(list(OUTPUT_COLUMNS)))
    record_lineage(run, Lineage(run.name, loop.base_model, v2.version, "dataset"))
    return v2.version


def _follow_up(loop: Loop, on_erasure: OnErasure) -> ErasureFollowUp:
    return ErasureFollowUp(loop.base_model, loop.settings.traces_root, loop.settings.work_dir, loop.registry,
                           loop.history, on_erasure, loop.settings.work_dir.parent / "audit.jsonl")


def test_flag_marks_the_version_trained_on_the_subject_once(make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    loop = make_loop()
    v2 = _trained_champion(loop, tmp_path)
    result = erase_subject(loop.settings.traces_root, TENANT, SUBJECT, loop.settings.work_dir)
    assert [(x.run_id, x.version) for x in result.trained_on] == [("run-2", v2)]

    follow_up = _follow_up(loop, OnErasure.FLAG)
    assert follow_up() == [f"v{v2}"]
    assert loop.registry.version(loop.base_model, v2).tags[Tag.TRAINED_ON_ERASED] == "1"
    assert loop.registry.champion(loop.base_model).version == v2  # flagged, still serving
    assert follow_up() == []  # flagged already
    [entry] = [json.loads(line) for line in (loop.settings.work_dir.parent / "audit.jsonl").read_text().splitlines()]
    assert entry["event"] == "erasure_lineage" and entry["drafter_versions"] == [f"{loop.base_model} v{v2}"]


def test_a_daemon_the_eraser_could_not_reach_scrubs_and_retires(make_loop: Callable[..., Loop],
                                                                tmp_path: Path) -> None:
    loop = make_loop()
    v2 = _trained_champion(loop, tmp_path)
    erase_subject(loop.settings.traces_root, TENANT, SUBJECT)  # on the engine's machine: no work dir there

    assert _follow_up(loop, OnErasure.RETIRE)() == [f"v{v2}"]
    train = pq.read_table(loop.settings.work_dir / "run-2" / "dataset" / "train.parquet")
    assert train["subject"].to_pylist() == [SUBJECT_B]
    assert loop.registry.champion(loop.base_model).version == "1"  # back to the one never trained on them
    event = loop.history.last(loop.base_model)
    assert (event.action, event.version, event.previous) == (Action.ROLLED_BACK, f"v{v2}", "v1")
    assert "erased" in loop.registry.version(loop.base_model, v2).tags[Tag.ROLLED_BACK]


def test_a_drafter_warm_started_from_a_tainted_one_is_tainted_too(make_loop: Callable[..., Loop],
                                                                 tmp_path: Path) -> None:
    loop = make_loop()
    v2 = _trained_champion(loop, tmp_path)
    v3 = loop.registry.register(tmp_path / "seed", loop.base_model)  # run-3 trained on others, from v2
    write_parquet_atomic(loop.settings.work_dir / "run-3" / "dataset" / "train.parquet",
                         to_arrow([make_trace("t-3", tenant=TENANT, subject=SUBJECT_B, base_model=loop.base_model)]
                                  ).select(list(OUTPUT_COLUMNS)))
    record_lineage(loop.settings.work_dir / "run-3", Lineage("run-3", loop.base_model, v3.version, "dataset", v2))
    promotion.await_approval(loop.registry, loop.history, v3, "test")
    erase_subject(loop.settings.traces_root, TENANT, SUBJECT, loop.settings.work_dir)

    assert sorted(_follow_up(loop, OnErasure.RETIRE)()) == [f"v{v2}", f"v{v3.version}"]
    assert loop.registry.version(loop.base_model, v3.version).tags[Tag.TRAINED_ON_ERASED] == "1"
    assert loop.registry.by_alias(loop.base_model, CHALLENGER) is None  # it can no longer be approved
    assert loop.registry.champion(loop.base_model).version == "1"


def test_keep_leaves_the_registry_alone(make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    loop = make_loop()
    v2 = _trained_champion(loop, tmp_path)
    erase_subject(loop.settings.traces_root, TENANT, SUBJECT, loop.settings.work_dir)
    assert _follow_up(loop, OnErasure.KEEP)() == []
    assert Tag.TRAINED_ON_ERASED not in loop.registry.version(loop.base_model, v2).tags


def test_another_base_models_first_drafter_started_from_a_tainted_one_is_tainted_too(
        make_loop: Callable[..., Loop], tmp_path: Path) -> None:
    loop = make_loop()
    v2 = _trained_champion(loop, tmp_path)
    variant = "0a0a0a0a0a0a0a0a"  # an NVFP4 variant of the model, whose first drafter started from v2
    first = loop.registry.version(variant, seed_champion(loop, tmp_path, base_model=variant))
    record_lineage(loop.settings.work_dir / "run-9", Lineage("run-9", variant, first.version, "shipped-prompts",
                                                             v2, loop.base_model))
    erase_subject(loop.settings.traces_root, TENANT, SUBJECT, loop.settings.work_dir)

    assert _follow_up(loop, OnErasure.FLAG)() == [f"v{v2}"]  # each daemon acts on its own base model
    follow_variant = ErasureFollowUp(variant, loop.settings.traces_root, loop.settings.work_dir, loop.registry,
                                     loop.history, OnErasure.FLAG, loop.settings.work_dir.parent / "audit.jsonl")
    assert follow_variant() == [f"v{first.version}"]
    assert loop.registry.version(variant, first.version).tags[Tag.TRAINED_ON_ERASED] == "1"
    # Without the lineage's base model the chain would look for v2 among the variant's own versions.
    record_lineage(loop.settings.work_dir / "run-9", Lineage("run-9", variant, first.version, "shipped-prompts", v2))
    loop.registry.set_tags(variant, first.version, {Tag.TRAINED_ON_ERASED: "0"})
    assert follow_variant._tainted(follow_variant._lineages()) == {}

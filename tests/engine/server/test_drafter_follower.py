"""The registry follower against a real MLflow registry (SQLite, local artifacts) and a real engine on a
tiny model: a champion is checked and swapped in; each kind of bad version is refused by reason and
leaves the serving drafter in place; a config that asks for more than the target allows is refused
before anything is allocated; an unreachable registry changes nothing and is retried; no exception,
whatever raises it, ends the follower's thread."""

import asyncio
import hashlib
import json
import logging
import resource
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.server.drafter_follower import DrafterFollower
from specloop.engine.speculation.dflash import DFlashConfig
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter, weight_bytes
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.broker import free_port
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(120)

FINGERPRINT = "0123456789abcdef"
OTHER = "fedcba9876543210"
PROBE = [1, 2, 3, 4, 5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> DrafterRegistry:
    root = tmp_path_factory.mktemp("registry")
    return DrafterRegistry(f"sqlite:///{root / 'mlflow.db'}", root / "artifacts")


@pytest.fixture
def target() -> torch.nn.Module:
    return tiny_target()


class Swaps:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, result: str, reason: str | None) -> None:
        self.seen.append((result, reason))


def artifact(path: Path, target, fingerprint: str = FINGERPRINT, seed: int = 1, block_size: int = 4) -> Path:
    return save_drafter(path, tiny_drafter(target, block_size=block_size, seed=seed), fingerprint,
                        Lineage("sha256:test", 1, seed))


@pytest.fixture
def running() -> Iterator[list[LLMEngine]]:
    """Engines started by `follower` (a swap is applied by the engine's loop), stopped after the test."""
    engines: list[LLMEngine] = []
    yield engines
    for engine in engines:
        engine.stop()


def follower(registry: DrafterRegistry, target, tmp_path: Path, fingerprint: str, swaps: Swaps,
             running: list[LLMEngine]) -> DrafterFollower:
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96, max_block_size=8), (),
                       NgramProposer(block_size=4))
    engine.start()
    running.append(engine)
    return DrafterFollower(registry, engine, target, fingerprint, DEFAULT_LEARNED_KIND, PROBE, tmp_path / "cache",
                           poll_s=60, record_swap=swaps)


def served(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], str | None, int]:
    """One greedy request through the running engine: its tokens, drafter version and verify steps."""
    async def run() -> list:
        return [d async for d in engine.stream(prompt, GREEDY)]

    deltas = asyncio.run(run())
    return [t for d in deltas for t in d.token_ids], deltas[-1].drafter_version, deltas[-1].spec.drafts


def champion_of(registry: DrafterRegistry, fingerprint: str, path: Path) -> str:
    version = registry.register(path, fingerprint)
    registry.set_alias(fingerprint, CHAMPION, version.version)
    return version.label


def test_a_champion_is_swapped_in_and_then_left_alone(registry: DrafterRegistry, target, tmp_path: Path,
                                                          running: list[LLMEngine],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    fingerprint = "1111111111111111"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    with caplog.at_level(logging.WARNING, logger="specloop.engine.server.drafter_follower"):
        assert f.check().result == "no_champion" and f.engine.drafter_version is None
        assert f.check().result == "no_champion"
    # Said once, not at every poll: what drafts until the daemon registers a drafter.
    said = [r.getMessage() for r in caplog.records if "lookup proposers draft alone" in r.getMessage()]
    assert len(said) == 1 and fingerprint in said[0]
    label = champion_of(registry, fingerprint, artifact(tmp_path / "a", target, fingerprint))

    result = f.check()

    assert (result.result, result.serving, result.champion) == ("swapped", label, label)
    assert f.engine.drafter_version == label and swaps.seen == [("ok", None)]
    assert f.check().result == "unchanged"
    tokens, version, drafts = served(f.engine, [5, 6, 7, 5, 6, 7])
    assert version == label and drafts > 0
    plain = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), ()).generate([[5, 6, 7, 5, 6, 7]], GREEDY)
    assert tokens == plain[0].output_ids


def test_a_champion_slower_than_suffix_decoding_alone_is_benched_until_a_contest_finds_it_faster(
        registry: DrafterRegistry, target, tmp_path: Path, running: list[LLMEngine]) -> None:
    fingerprint = "1212121212121212"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    label = champion_of(registry, fingerprint, artifact(tmp_path / "a", target, fingerprint))
    assert f.check().result == "swapped" and f.engine.drafter_version == label  # not judged yet: it serves
    registry.set_tags(fingerprint, label[1:], {Tag.SPEED_OVER_SUFFIX: "-0.05", Tag.BENCHED: "true"})
    swap, applied = f.engine.swap, []
    f.engine.swap = lambda build: applied.append(build) or swap(build)

    benched = f.check()

    assert (benched.result, benched.serving, benched.champion) == ("benched", None, label)
    assert "-5.0%" in benched.detail and f.engine.drafter_version is None
    assert f.check().result == "benched" and len(applied) == 1  # benched once, then left alone
    f.engine.swap = swap
    tokens, version, drafts = served(f.engine, [5, 6, 7, 5, 6, 7, 5, 6])
    assert version is None and drafts > 0  # suffix decoding drafts alone
    plain = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), ()).generate([[5, 6, 7, 5, 6, 7, 5, 6]], GREEDY)
    assert tokens == plain[0].output_ids
    registry.set_tags(fingerprint, label[1:], {Tag.SPEED_OVER_SUFFIX: "0.04", Tag.BENCHED: "false"})
    assert f.check().result == "swapped" and f.engine.drafter_version == label
    # An engine drafting with another kind is not judged by a contest of suffix decoding: it keeps the drafter.
    other = DrafterFollower(registry, f.engine, target, fingerprint, "combined", PROBE, tmp_path / "c", poll_s=60)
    registry.set_tags(fingerprint, label[1:], {Tag.BENCHED: "true"})
    assert other._slower_than_lookup(registry.champion(fingerprint)) is False
    assert f.check().result == "benched"
    # A tag set by hand that is neither "true" nor "false" serves the drafter again, as one no contest judged.
    registry._client.set_model_version_tag(registry.champion(fingerprint).name, label[1:], Tag.BENCHED, "yes")
    assert f.check().result == "swapped" and f.engine.drafter_version == label


def _corrupt_weights(path: Path, target, fingerprint: str) -> None:
    artifact(path, target, fingerprint)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)


def _wrong_target(path: Path, target, fingerprint: str) -> None:
    artifact(path, tiny_target(hidden=64), fingerprint)  # a drafter for a wider model, same fingerprint


def _nan_weights(path: Path, target, fingerprint: str) -> None:
    artifact(path, target, fingerprint)
    tensors = load_file(path / "model.safetensors")
    name = next(k for k in tensors if k.endswith("weight") and tensors[k].dim() == 2)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path / "model.safetensors")


def _overflowing_weights(path: Path, target, fingerprint: str) -> None:
    """Finite weights whose products overflow: only a real propose finds them out."""
    artifact(path, target, fingerprint)
    tensors = {k: v * 1e30 if v.dim() == 2 else v for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")


def _block_too_long(path: Path, target, fingerprint: str) -> None:
    artifact(path, target, fingerprint, block_size=16)  # the engine here allows blocks of up to 8


@pytest.mark.parametrize(("damage", "reason"), [
    (_corrupt_weights, "weights"), (_wrong_target, "config"), (_nan_weights, "weights"),
    (_overflowing_weights, "propose"), (_block_too_long, "config"),
])
def test_a_bad_version_is_refused_by_reason_and_not_retried(registry: DrafterRegistry, target, tmp_path: Path,
                                                             running: list[LLMEngine], damage, reason: str) -> None:
    fingerprint = hashlib.sha256(damage.__name__.encode()).hexdigest()[:16]
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    good = champion_of(registry, fingerprint, artifact(tmp_path / "good", target, fingerprint))
    assert f.check().result == "swapped"
    damage(tmp_path / "bad", target, fingerprint)
    bad = champion_of(registry, fingerprint, tmp_path / "bad")

    refused = f.check()

    assert (refused.result, refused.reason, refused.champion) == ("refused", reason, bad)
    assert f.engine.drafter_version == good and refused.serving == good
    assert swaps.seen == [("ok", None), ("refused", reason)]
    again = f.check()  # the alias has not moved: not tried again, not counted again
    assert again.result == "refused" and again.reason is None and swaps.seen[-1] == ("refused", reason)
    assert served(f.engine, [1, 2, 3, 1, 2, 3])[1] == good


def test_a_drafter_for_another_base_model_is_refused(registry: DrafterRegistry, target, tmp_path: Path,
                                                          running: list[LLMEngine]) -> None:
    fingerprint = "3333333333333333"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    version = registry.register(artifact(tmp_path / "a", target, fingerprint), fingerprint)
    registry.set_alias(fingerprint, CHAMPION, version.version)
    # register() refuses such an artifact itself; one that reaches the engine anyway (another client
    # wrote the registry, a tampered store) is refused there too. Here: its download names another model.
    artifact(registry.download(version, tmp_path / "cache", 1 << 30), target, OTHER)

    result = f.check()

    assert (result.result, result.reason) == ("refused", "fingerprint")
    assert f.engine.drafter_version is None and swaps.seen == [("refused", "fingerprint")]


def test_a_version_without_its_files_is_refused_as_a_failed_download(registry: DrafterRegistry, target,
                                                                     tmp_path: Path, running: list[LLMEngine]) -> None:
    fingerprint = "2222222222222222"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    version = registry.register(artifact(tmp_path / "a", target, fingerprint), fingerprint)
    registry.set_alias(fingerprint, CHAMPION, version.version)
    stored = Path(version.source.removeprefix("file://"))
    assert stored.is_dir(), version.source
    shutil.rmtree(stored)

    result = f.check()

    assert (result.result, result.reason) == ("refused", "download")
    assert f.engine.drafter_version is None


def test_an_unreachable_registry_leaves_serving_alone(target, tmp_path: Path, running: list[LLMEngine]) -> None:
    swaps = Swaps()
    down = DrafterRegistry(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    f = follower(down, target, tmp_path, FINGERPRINT, swaps, running)

    results = [f.check() for _ in range(3)]

    assert [r.result for r in results] == ["unavailable"] * 3 and swaps.seen == []
    assert f._backoff_s() == 4.0  # 1, 2, 4 s after the first, second and third failed lookup
    _, version, drafts = served(f.engine, [1, 2, 3, 1, 2, 3])
    assert version is None and drafts > 0  # n-gram lookup still drafts


def _asking_for(field: str, value: object):  # noqa: ANN202 - a damage function for the table below
    def damage(path: Path, target, fingerprint: str) -> None:
        artifact(path, target, fingerprint)
        meta = json.loads((path / "drafter.json").read_text())
        meta["config"][field] = value
        (path / "drafter.json").write_text(json.dumps(meta))
    damage.__name__ = f"asking_for_{field}_{value}"
    return damage


# Each would allocate gigabytes or more if built: the tiny target's widths are 32, its depth 4.
@pytest.mark.parametrize("damage", [
    _asking_for("num_layers", 100_000), _asking_for("intermediate_size", 1 << 40), _asking_for("max_position", 1 << 40),
    _asking_for("num_heads", 1 << 30), _asking_for("num_kv_heads", 1 << 30), _asking_for("head_dim", 1 << 30),
    _asking_for("hidden_size", 1 << 30), _asking_for("output_vocab_size", 1 << 40),
    _asking_for("num_layers", 2.5), _asking_for("num_layers", "1"), _asking_for("rope_theta", float("nan")),
    _asking_for("tap_layers", "0123"),
], ids=lambda d: d.__name__)
def test_a_config_asking_for_too_much_is_refused_before_allocation(registry: DrafterRegistry, target,
                                                                   tmp_path: Path, running: list[LLMEngine],
                                                                   damage) -> None:
    fingerprint = hashlib.sha256(damage.__name__.encode()).hexdigest()[:16]
    f = follower(registry, target, tmp_path, fingerprint, Swaps(), running)
    damage(tmp_path / "bad", target, fingerprint)
    champion_of(registry, fingerprint, tmp_path / "bad")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB

    result = f.check()

    assert (result.result, result.reason) == ("refused", "config"), result
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 << 10  # < 64 MiB more at the peak


def test_weights_larger_than_their_config_implies_are_refused_unread(registry: DrafterRegistry, target,
                                                                     tmp_path: Path, running: list[LLMEngine]) -> None:
    fingerprint = "5555555555555555"
    f = follower(registry, target, tmp_path, fingerprint, Swaps(), running)
    path = artifact(tmp_path / "big", target, fingerprint)
    most = weight_bytes(DFlashConfig.from_json(json.loads((path / "drafter.json").read_text())["config"]))
    with open(path / "model.safetensors", "ab") as weights:  # within the download bound, past this config's
        weights.write(b"\0" * (most - (path / "model.safetensors").stat().st_size + 1))
    champion_of(registry, fingerprint, path)

    result = f.check()

    assert (result.result, result.reason) == ("refused", "weights")
    assert "more than its config's tensors" in result.detail


@pytest.mark.parametrize("error", [RuntimeError("boom"), TypeError("bad value"), KeyError("missing"), MemoryError(),
                                   OSError("disk"), AssertionError("bug")], ids=lambda e: type(e).__name__)
def test_the_follower_thread_survives_any_exception_and_keeps_following(registry: DrafterRegistry, target,
                                                                        tmp_path: Path, running: list[LLMEngine],
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        error: Exception) -> None:
    fingerprint = hashlib.sha256(type(error).__name__.encode()).hexdigest()[:16]
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    f.poll_s = 0.05
    label = champion_of(registry, fingerprint, artifact(tmp_path / "a", target, fingerprint))
    real = registry.champion
    calls = []

    def failing(base_model: str):  # noqa: ANN202
        calls.append(base_model)
        if len(calls) <= 2:
            raise error
        return real(base_model)

    monkeypatch.setattr(registry, "champion", failing)
    monkeypatch.setattr("specloop.engine.server.drafter_follower._BACKOFF_S", (0.05, 0.05))
    f.start()
    try:
        deadline = time.monotonic() + 30
        while f.engine.drafter_version != label:
            assert time.monotonic() < deadline and f._thread.is_alive(), (calls, swaps.seen)
            time.sleep(0.05)
    finally:
        f.stop()
    assert swaps.seen[:2] == [("refused", "error")] * 2 and swaps.seen[-1] == ("ok", None)
    assert not any(t.name == "drafter-follower" and t is f._thread for t in threading.enumerate())


def test_a_version_whose_build_raises_is_refused_once_until_the_alias_moves(registry: DrafterRegistry, target,
                                                                            tmp_path: Path, running: list[LLMEngine],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    fingerprint = "6666666666666666"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    champion_of(registry, fingerprint, artifact(tmp_path / "a", target, fingerprint))
    monkeypatch.setattr(f, "_proposer", lambda drafter, version: (_ for _ in ()).throw(RuntimeError("no memory")))

    assert (f.check().result, f.check().result) == ("refused", "refused")
    assert swaps.seen == [("refused", "error")]  # tried once, not at every poll
    monkeypatch.undo()
    moved = champion_of(registry, fingerprint, artifact(tmp_path / "b", target, fingerprint, seed=2))
    assert f.check().result == "swapped" and f.engine.drafter_version == moved

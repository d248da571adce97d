"""The registry follower against a real MLflow registry (SQLite, local artifacts) and a real engine on a
tiny model: a champion is checked and swapped in; each kind of bad version is refused by reason and
leaves the serving drafter in place; an unreachable registry changes nothing and is retried."""

import asyncio
import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.engine.server.drafter_follower import DrafterFollower
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.broker import free_port
from specloop.storage.registry import CHAMPION, DrafterRegistry
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
    return DrafterFollower(registry, engine, target, fingerprint, "combined", PROBE, tmp_path / "cache",
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
                                                          running: list[LLMEngine]) -> None:
    fingerprint = "1111111111111111"
    swaps = Swaps()
    f = follower(registry, target, tmp_path, fingerprint, swaps, running)
    assert f.check().result == "no_champion" and f.engine.drafter_version is None
    label = champion_of(registry, fingerprint, artifact(tmp_path / "a", target, fingerprint))

    result = f.check()

    assert (result.result, result.serving, result.champion) == ("swapped", label, label)
    assert f.engine.drafter_version == label and swaps.seen == [("ok", None)]
    assert f.check().result == "unchanged"
    tokens, version, drafts = served(f.engine, [5, 6, 7, 5, 6, 7])
    assert version == label and drafts > 0
    plain = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), ()).generate([[5, 6, 7, 5, 6, 7]], GREEDY)
    assert tokens == plain[0].output_ids


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
    artifact(registry.download(version, tmp_path / "cache"), target, OTHER)

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

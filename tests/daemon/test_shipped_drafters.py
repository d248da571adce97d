"""The shipped drafters: seeding an empty registry, leaving a used one alone, and every shipped artifact
checked against the real model it ships for."""

from pathlib import Path

import pytest
import torch

from specloop.daemon.shipped_drafters import SHIPPED, seed_registry, shipped_drafters
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.server.drafter_follower import check_artifact
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.storage.registry import CHAMPION, DrafterRegistry
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(120)


def test_an_empty_registry_gets_each_shipped_drafter_as_champion_once(tmp_path: Path) -> None:
    root = tmp_path / "drafters"
    save_drafter(root / "tiny", tiny_drafter(tiny_target()), "5555555555555555", Lineage("d", 1, 0))
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")

    [seeded] = seed_registry(registry, root)

    assert (seeded.version, seeded.base_model, seeded.tags["source"]) == ("1", "5555555555555555", "shipped:tiny")
    assert registry.champion("5555555555555555").version == "1"
    assert seed_registry(registry, root) == [] and len(registry.versions("5555555555555555")) == 1


def test_a_registry_that_holds_versions_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "drafters"
    save_drafter(root / "tiny", tiny_drafter(tiny_target()), "6666666666666666", Lineage("d", 1, 0))
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    promoted = registry.register(root / "tiny", "6666666666666666")
    registry.delete_alias("6666666666666666", CHAMPION)  # e.g. rolled back to nothing on purpose

    assert seed_registry(registry, root) == []
    assert registry.champion("6666666666666666") is None and registry.versions("6666666666666666") == [promoted]


def test_every_shipped_drafter_fits_the_model_it_ships_for(smollm2: LoadedModel) -> None:
    shipped = shipped_drafters(SHIPPED)
    assert set(shipped) == {smollm2.fingerprint}  # the default model's, and only it
    drafter = check_artifact(shipped[smollm2.fingerprint], smollm2.fingerprint, smollm2.model, max_block_size=16)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    assert (shipped[smollm2.fingerprint] / "README.md").is_file()

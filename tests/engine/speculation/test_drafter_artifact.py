"""Drafter artifact: round trip, no target weights inside, fingerprint refusal, and the size bounds an
artifact from a registry is held to."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.drafter_artifact import (
    MAX_CONFIG_BYTES,
    Lineage,
    load_drafter,
    max_artifact_bytes,
    read_meta,
    save_drafter,
    weight_bytes,
)
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(30)


def test_round_trip_keeps_weights_config_and_lineage(tmp_path: Path) -> None:
    drafter = tiny_drafter(tiny_target())
    save_drafter(tmp_path, drafter, "fp-abc", Lineage("sha256:00", 12, 7, {"train_sequences": 3}))
    loaded = load_drafter(tmp_path, "fp-abc")
    assert loaded.drafter.config == drafter.config
    for (name, a), b in zip(drafter.state_dict().items(), loaded.drafter.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert loaded.lineage == Lineage("sha256:00", 12, 7, {"train_sequences": 3})
    meta = read_meta(tmp_path)
    assert meta["config"]["tap_layers"] == list(drafter.config.tap_layers)
    assert meta["config"]["mask_token_id"] is None and meta["config"]["block_size"] == 4
    # The target's embedding and LM head are borrowed, never stored.
    assert not any("embed" in k and "mask" not in k or "lm_head" in k for k in load_file(tmp_path / "model.safetensors"))


def test_other_fingerprint_is_refused(tmp_path: Path) -> None:
    save_drafter(tmp_path, tiny_drafter(tiny_target()), "fp-abc", Lineage("d", 1, 0))
    with pytest.raises(ValueError, match="trained for base model fp-abc.*served model is fp-xyz"):
        load_drafter(tmp_path, "fp-xyz")


def test_trimmed_vocabulary_round_trips(tmp_path: Path) -> None:
    cfg = DFlashConfig.for_target(tiny_target().config, 1, 2, 4)
    drafter = DFlashDrafter(DFlashConfig(**{**cfg.to_json(), "tap_layers": cfg.tap_layers, "output_vocab_size": 3}))
    drafter.vocab_ids.copy_(torch.tensor([5, 9, 40]))
    save_drafter(tmp_path, drafter, "fp", Lineage("d", 1, 0))
    assert load_drafter(tmp_path, "fp").drafter.vocab_ids.tolist() == [5, 9, 40]


def test_missing_or_foreign_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no drafter.json"):
        load_drafter(tmp_path, "fp")
    (tmp_path / "drafter.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="format"):
        load_drafter(tmp_path, "fp")


@pytest.mark.parametrize("layers, taps, mask_token_id, trimmed", [(1, 2, None, None), (2, 3, 7, 5), (4, 1, None, 60)])
def test_weight_bytes_bounds_the_tensors_a_config_builds(tmp_path: Path, layers: int, taps: int,
                                                         mask_token_id: int | None, trimmed: int | None) -> None:
    config = dataclasses.replace(DFlashConfig.for_target(tiny_target().config, layers, taps, 4, mask_token_id),
                                 output_vocab_size=trimmed)
    drafter = DFlashDrafter(config)
    tensors = sum(t.numel() * max(t.element_size(), 4) for t in drafter.state_dict().values())
    assert weight_bytes(config) - (1 << 20) == tensors  # exactly the tensors, plus the header allowance
    save_drafter(tmp_path, drafter, "fp", Lineage("d", 1, 0))
    assert (tmp_path / "model.safetensors").stat().st_size <= weight_bytes(config)
    assert weight_bytes(config) + MAX_CONFIG_BYTES <= max_artifact_bytes(tiny_target().config)


def test_an_oversized_config_file_is_refused_unread(tmp_path: Path) -> None:
    save_drafter(tmp_path, tiny_drafter(tiny_target()), "fp", Lineage("d", 1, 0))
    (tmp_path / "drafter.json").write_text("[" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_meta(tmp_path)

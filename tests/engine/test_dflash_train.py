"""DFlash training: anchors, loss falls on a learnable toy set, exact resume, trimming, early stop."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.dflash_train import Batch, Trainer, TrainConfig, sample_anchors
from engine.drafter_artifact import load_drafter, read_meta
from engine.training_data import TokenSequence
from tests.engine.dflash_helpers import tiny_target

pytestmark = pytest.mark.timeout(120)


CYCLE = (11, 23, 5, 40, 17, 33)


def cycling(n: int) -> list[TokenSequence]:
    """Responses that walk a fixed cycle of tokens from a random offset: the anchor token alone
    determines the whole block, so a drafter can learn it in a few dozen steps."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        offset = int(torch.randint(0, len(CYCLE), (1,), generator=g))
        prompt = tuple(int(t) for t in torch.randint(0, 64, (4,), generator=g))
        out.append(TokenSequence(prompt, tuple(CYCLE[(offset + i) % len(CYCLE)] for i in range(24))))
    return out


def config(tmp_path: Path, **kw: object) -> TrainConfig:
    base = dict(out_dir=str(tmp_path), num_layers=1, num_taps=2, block_size=4, max_steps=40, batch_size=4,
                num_anchors=8, max_seq_len=64, lr=1e-2, heldout_fraction=0.2, eval_every=10, patience=10,
                checkpoint_every=20, progress=False)
    return TrainConfig(**{**base, **kw})


def test_anchors_lie_in_the_response_with_a_token_after() -> None:
    batch = Batch.of([TokenSequence((1, 2, 3), (4, 5, 6)), TokenSequence((1,), (2, 3))], 16, torch.device("cpu"))
    anchors, keep = sample_anchors(batch, 8, torch.Generator().manual_seed(0))
    # Row 0 may anchor at 3 or 4 (the last token has nothing after it), row 1 only at 1.
    assert anchors.tolist() == [[3, 4], [1, 0]] and keep.tolist() == [[True, True], [True, False]]


def test_loss_falls_and_artifact_is_written(tmp_path: Path) -> None:
    result = Trainer(config(tmp_path), tiny_target(), "fp-toy", cycling(40)).run()
    first, last = result.history[0]["heldout_loss"], result.history[-1]["heldout_loss"]
    assert last < 0.7 * first, result.history
    assert result.history[-1]["heldout_accuracy"] > 0.4
    art = load_drafter(tmp_path, "fp-toy")
    assert art.lineage.steps == 40 and art.lineage.seed == 0 and art.lineage.data_digest.startswith("sha256:")


def test_resume_repeats_the_same_run(tmp_path: Path) -> None:
    seqs, target = cycling(12), tiny_target()
    straight = Trainer(config(tmp_path / "a", max_steps=10, checkpoint_every=5, heldout_fraction=0.0), target, "fp", seqs)
    straight.run()
    first = Trainer(config(tmp_path / "b", max_steps=10, checkpoint_every=5, heldout_fraction=0.0), target, "fp", seqs)
    first.advance(5)
    resumed = Trainer(config(tmp_path / "b", max_steps=10, checkpoint_every=5, heldout_fraction=0.0), target, "fp", seqs)
    assert resumed.step == 5
    resumed.run()
    for (name, a), b in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_resume_refuses_other_data(tmp_path: Path) -> None:
    Trainer(config(tmp_path, max_steps=2), tiny_target(), "fp", cycling(12)).run()
    with pytest.raises(ValueError, match="other data"):
        Trainer(config(tmp_path, max_steps=4), tiny_target(), "fp", cycling(13))


def test_trimmed_vocabulary_and_warm_start(tmp_path: Path) -> None:
    seqs = [TokenSequence((1, 2), (5, 6, 7, 5, 6, 7, 5, 6)) for _ in range(6)]
    Trainer(config(tmp_path / "t", max_steps=3, heldout_fraction=0.0), tiny_target(), "fp", seqs).run()
    cfg = config(tmp_path / "t2", max_steps=3, heldout_fraction=0.0, trim_vocab=True)
    Trainer(cfg, tiny_target(), "fp", seqs).run()
    assert read_meta(tmp_path / "t2")["config"]["output_vocab_size"] == 3
    warm = Trainer(replace(cfg, out_dir=str(tmp_path / "t3"), init_from=str(tmp_path / "t2")), tiny_target(), "fp", seqs)
    assert warm.drafter.vocab_ids.tolist() == [5, 6, 7]


def test_early_stop_when_heldout_stops_improving(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_steps=200, lr=1e-9, warmup_ratio=0.0, eval_every=2, patience=2)
    result = Trainer(cfg, tiny_target(), "fp", cycling(20)).run()
    assert result.stop_reason == "early_stop" and result.steps < 200


def test_feature_cache_gives_the_same_training(tmp_path: Path) -> None:
    seqs, target = cycling(8), tiny_target()
    cached = Trainer(config(tmp_path / "c", max_steps=4, heldout_fraction=0.0), target, "fp", seqs)
    fresh = Trainer(config(tmp_path / "f", max_steps=4, heldout_fraction=0.0, feature_cache_gb=0.0), target, "fp", seqs)
    cached.advance(4)
    fresh.advance(4)
    assert len(cached.features) == 8 and not fresh.features
    for (name, a), b in zip(cached.drafter.state_dict().items(), fresh.drafter.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_heldout_tau_is_tracked_and_rises_with_training(tmp_path: Path) -> None:
    result = Trainer(config(tmp_path, eval_tau=True), tiny_target(), "fp", cycling(40)).run()
    taus = [point["heldout_tau"] for point in result.history]
    seen = [point["response_tokens_seen"] for point in result.history]
    assert 1.0 <= taus[0] < taus[-1] and taus[-1] > 2.0, taus
    assert seen == sorted(seen) and seen[-1] == 40 * 4 * 24  # 40 steps of 4 sequences of 24 response tokens

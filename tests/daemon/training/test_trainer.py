"""DFlash training: anchors, loss falls on a learnable toy set, exact resume, trimming, early stop."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.objective import Batch, block_labels, sample_anchors
from specloop.daemon.training.optimizer_step import lr_factor
from specloop.daemon.training.suffix_covered import suffix_covered
from specloop.daemon.training.trainer import Trainer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter, read_meta
from specloop.storage.sequences import TokenSequence
from tests.dflash_helpers import tiny_target

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


def test_distillation_anchors_anywhere_after_the_first_token() -> None:
    batch = Batch.of([TokenSequence((1, 2, 3), (4, 5, 6))], 16, torch.device("cpu"))
    anchors, keep = sample_anchors(batch, 8, torch.Generator().manual_seed(0), in_prompt=True)
    assert anchors.tolist() == [[1, 2, 3, 4]] and keep.all()


def test_skipped_positions_are_never_anchors() -> None:
    skip = [torch.tensor([False, False, False, True, False, False])]
    batch = Batch.of([TokenSequence((1, 2, 3), (4, 5, 6))], 16, torch.device("cpu"), skip)
    anchors, keep = sample_anchors(batch, 8, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [[4]] and keep.all()  # 3 is skipped, 5 has nothing after it


def test_suffix_decoding_covers_what_earlier_traces_repeat() -> None:
    first = TokenSequence((1, 2), (7, 8, 9, 10, 11, 12, 13, 14))
    again = TokenSequence((3, 4), (7, 8, 9, 10, 11, 12, 13, 14))  # the same answer to another prompt
    covered = suffix_covered([first, again], max_len=64)
    assert [c.shape[0] for c in covered] == [10, 10]
    assert not covered[0].any()  # nothing before it, and no repeat in its own context
    # The second answer's positions after a 2-token match of the first one (from 8 on) are drafted by
    # suffix decoding; its last token has nothing after it.
    assert covered[1].tolist() == [False] * 3 + [True] * 6 + [False]


def test_training_skips_the_covered_anchors_and_still_learns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tiny_target()
    seqs = cycling(48)
    with caplog.at_level("INFO"):
        trainer = Trainer(config(tmp_path, skip_suffix_covered=True), target, "0123456789abcdef", seqs)
    assert "suffix decoding drafts after" in caplog.text
    assert trainer.data.skipped is not None and any(s.any() for s in trainer.data.skipped)
    _, batch = trainer.data.batch(0)
    anchors, keep = sample_anchors(batch, 8, torch.Generator().manual_seed(0))
    assert not batch.skipped.gather(1, anchors)[keep].any()
    result = trainer.run()
    first, last = result.history[0]["heldout_loss"], result.history[-1]["heldout_loss"]
    # Held-out loss is over every position; training saw only the 9% suffix decoding misses here.
    assert result.steps == 40 and last < first, result.history


def test_distillation_labels_follow_the_targets_greedy_path() -> None:
    batch = Batch.of([TokenSequence((1, 2), (3, 4, 5, 6))], 16, torch.device("cpu"))
    # The target's pick after each position: right after 1, 2 and 4; after 3 it would say 9, not 4.
    batch = Batch(batch.tokens, batch.prompt_lens, batch.lengths, greedy_next=torch.tensor([[2, 3, 9, 5, 6, 7]]))
    label_pos = torch.tensor([[[1, 2, 3, 4], [3, 4, 5, 6]]])  # anchors 1 and 3, block size 4
    labels, usable = block_labels(batch, label_pos, distill=True)
    # Anchor 1: k=1 → 3 (after "2"), k=2 → 9 (the target's pick, not the stored 4), k=3 is off the
    # greedy path (the stored 4 ≠ 9), so unsupervised. Anchor 3: k=3 lies past the end.
    assert labels[0, 0, 1:].tolist() == [3, 9, 5] and usable[0, 0].tolist() == [True, True, True, False]
    assert labels[0, 1, 1:3].tolist() == [5, 6] and usable[0, 1].tolist() == [True, True, True, False]
    stored, inside = block_labels(batch, label_pos, distill=False)
    assert stored[0, 0].tolist() == [2, 3, 4, 5] and inside[0, 0].all()


@torch.no_grad()
def greedy_answers(target: torch.nn.Module, n: int, length: int = 24) -> list[TokenSequence]:
    """The target's own greedy continuations of random 4-token prompts."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 64, (1, 4), generator=g)
        for _ in range(length):
            hidden, _ = target(tokens)
            tokens = torch.cat([tokens, target.logits(hidden[:, -1:]).argmax(-1)], dim=1)
        out.append(TokenSequence(tuple(tokens[0, :4].tolist()), tuple(tokens[0, 4:].tolist())))
    return out


def test_distillation_labels_equal_stored_greedy_answers() -> None:
    """On the target's own greedy outputs every response label is the stored token, all supervised."""
    target = tiny_target()
    batch = Batch.of(greedy_answers(target, 3), 64, torch.device("cpu"))
    hidden, _ = target(batch.tokens)
    batch = Batch(batch.tokens, batch.prompt_lens, batch.lengths, greedy_next=target.logits(hidden).argmax(-1))
    label_pos = torch.arange(4, 25).view(1, -1, 1) + torch.arange(4)  # anchors over the response
    label_pos = label_pos.expand(3, -1, -1)
    labels, usable = block_labels(batch, label_pos, distill=True)
    stored, inside = block_labels(batch, label_pos, distill=False)
    assert torch.equal(usable, inside) and torch.equal(labels[inside], stored[inside])


def echo_target() -> torch.nn.Module:
    """A tiny target whose greedy pick is always the current token: its layers add nothing to the
    residual, and its tied LM head scores each token's own embedding highest."""
    target = tiny_target()
    with torch.no_grad():
        for layer in target.layers:
            layer.attn.o.weight.zero_()
            layer.mlp.down.weight.zero_()
        tokens = torch.arange(64).view(1, -1)
        assert torch.equal(target.logits(target(tokens)[0]).argmax(-1), tokens)
    return target


def first_drafts(proposer: DFlashProposer, seq: TokenSequence) -> tuple[list[int], list[int]]:
    """(first draft, anchor token) at every response position of `seq` but the last."""
    tokens = torch.tensor([seq.tokens])
    proposer.allocate(1, tokens.shape[1] + proposer.block_size)
    proposer.observe([0], [0], proposer.target(tokens, taps=proposer.tap_layers)[1], tokens)
    anchors = range(len(seq.prompt), tokens.shape[1] - 1)
    drafts = [int(proposer.propose([0], [p], tokens[0, p:p + 1], [])[0, 0]) for p in anchors]
    return drafts, [seq.tokens[p] for p in anchors]


def test_distilled_mixed_precision_training_learns_the_target_not_the_data(tmp_path: Path) -> None:
    """On cycling data the stored next token is the cycle's, but the target would repeat the current
    token: a distilled drafter drafts the target's pick (the anchor token), a plain one the cycle's."""
    target, unseen = echo_target(), cycling(41)[-1]
    echoed = {}
    for distill in (False, True):
        trainer = Trainer(config(tmp_path / str(distill), distill=distill, mixed_precision=distill), target, "fp",
                          cycling(40))
        trainer.run()
        drafts, anchors = first_drafts(DFlashProposer(trainer.drafter, target), unseen)
        echoed[distill] = sum(d == a for d, a in zip(drafts, anchors, strict=True)) / len(drafts)
    assert echoed[True] > 0.9 and echoed[False] < 0.1, echoed


def test_loss_falls_and_artifact_is_written(tmp_path: Path) -> None:
    result = Trainer(config(tmp_path), tiny_target(), "fp-toy", cycling(40)).run()
    first, last = result.history[0]["heldout_loss"], result.history[-1]["heldout_loss"]
    assert last < 0.7 * first, result.history
    assert result.history[-1]["heldout_accuracy"] > 0.4
    art = load_drafter(tmp_path, "fp-toy")
    assert art.lineage.steps == 40 and art.lineage.seed == 0 and art.lineage.data_digest.startswith("sha256:")


def test_schedule_anneals_over_whichever_budget_is_further_along(tmp_path: Path) -> None:
    assert lr_factor(0, 100, 0.1) == pytest.approx(0.1)  # warmup counts steps, whatever the clock says
    assert lr_factor(0, 100, 0.1, time_fraction=0.9) == pytest.approx(0.1)
    assert lr_factor(55, 100, 0.1) == pytest.approx(0.5)  # halfway through the decay by steps
    assert lr_factor(55, 100, 0.1, time_fraction=0.2) == pytest.approx(0.5)
    assert lr_factor(20, 100, 0.1, time_fraction=0.5) == pytest.approx(0.5)  # the clock is further along
    assert lr_factor(20, 100, 0.1, time_fraction=1.0) == pytest.approx(0.0)
    trainer = Trainer(config(tmp_path, max_steps=100, max_seconds=60.0), tiny_target(), "fp", cycling(8))
    trainer.step, trainer.elapsed = 20, 45.0
    expected = lr_factor(20, 100, 0.04, time_fraction=0.75)
    assert trainer.optimizer_step.lr_factor(trainer.step, trainer.elapsed) == pytest.approx(expected)
    trainer.advance(21)
    assert trainer.optimizer_step.opt.param_groups[0]["lr"] == pytest.approx(1e-2 * expected)


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
    # New traffic with new tokens widens the vocabulary; every learned weight carries over.
    new = [TokenSequence((1, 2), (9, 5, 8, 9, 5, 8)) for _ in range(6)]
    wide = Trainer(replace(cfg, out_dir=str(tmp_path / "t4"), init_from=str(tmp_path / "t2")), tiny_target(), "fp", new)
    assert wide.drafter.vocab_ids.tolist() == [5, 6, 7, 8, 9]
    before = load_drafter(tmp_path / "t2", "fp").drafter.state_dict()
    for name, w in wide.drafter.state_dict().items():
        if name != "vocab_ids":
            torch.testing.assert_close(w, before[name], msg=name)
    kept = Trainer(replace(cfg, out_dir=str(tmp_path / "t5"), init_from=str(tmp_path / "t2"), trim_vocab=False),
                   tiny_target(), "fp", new)
    assert kept.drafter.vocab_ids.tolist() == [5, 6, 7]


def test_a_warm_start_from_another_base_model_trains_for_this_one(tmp_path: Path) -> None:
    seqs = cycling(8)
    cfg = config(tmp_path / "dense", max_steps=2, heldout_fraction=0.0)
    Trainer(cfg, tiny_target(), "fp-dense", seqs).run()
    # Another model of the same shape (its NVFP4 quantization, a fine-tune): its own artifact, the parent named.
    Trainer(replace(cfg, out_dir=str(tmp_path / "q"), init_from=str(tmp_path / "dense")), tiny_target(seed=1),
            "fp-nvfp4", seqs).run()
    meta = read_meta(tmp_path / "q")
    assert (meta["base_model_fingerprint"], meta["lineage"]["warm_start_base_model"]) == ("fp-nvfp4", "fp-dense")
    with pytest.raises(ValueError, match="init_from .*dense: drafter was built for a 6-layer target, got 8"):
        Trainer(replace(cfg, out_dir=str(tmp_path / "x"), init_from=str(tmp_path / "dense")), tiny_target(layers=8),
                "fp-deeper", seqs)


def block_outputs(drafter: torch.nn.Module) -> torch.Tensor:
    """The drafter's final hidden states `[1, 4, H]` for one fixed block over a fixed random context."""
    g = torch.Generator().manual_seed(3)
    H, T = drafter.config.hidden_size, 6
    fused = torch.randn(1, T, H, generator=g)
    ctx = drafter.context_kv(fused, torch.arange(T).unsqueeze(0))
    x = torch.randn(1, 4, H, generator=g)
    return drafter.run_blocks(x, torch.arange(T, T + 4).unsqueeze(0), ctx, torch.ones(1, 1, 4, T + 4, dtype=torch.bool))


def test_warm_start_reshapes_the_drafter_without_changing_its_outputs(tmp_path: Path) -> None:
    seqs = cycling(12)
    cfg = config(tmp_path / "one", max_steps=6, heldout_fraction=0.0)
    Trainer(cfg, tiny_target(), "fp", seqs).run()
    shallow = load_drafter(tmp_path / "one", "fp").drafter
    deep = Trainer(replace(cfg, out_dir=str(tmp_path / "two"), init_from=str(tmp_path / "one"), num_layers=2),
                   tiny_target(), "fp", seqs)
    assert deep.drafter.config.num_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(block_outputs(deep.drafter), block_outputs(shallow))
    deep.run()
    grown = load_drafter(tmp_path / "two", "fp").drafter
    assert grown.config.num_layers == 2 and grown.layers[1].o.weight.abs().sum() > 0  # the new layer learned
    same = Trainer(replace(cfg, out_dir=str(tmp_path / "same"), init_from=str(tmp_path / "two"), num_layers=None),
                   tiny_target(), "fp", seqs)
    assert same.drafter.config.num_layers == 2  # no --layers: the artifact's depth
    with pytest.raises(ValueError, match="fewer than the warm-start drafter's 2"):
        Trainer(replace(cfg, out_dir=str(tmp_path / "x"), init_from=str(tmp_path / "two"), num_layers=1),
                tiny_target(), "fp", seqs)
    with pytest.raises(ValueError, match="num_taps 3 differs from the warm-start drafter's 2"):
        Trainer(replace(cfg, out_dir=str(tmp_path / "x"), init_from=str(tmp_path / "two"), num_layers=None, num_taps=3),
                tiny_target(), "fp", seqs)
    # No weight depends on the block size, so a warm start may train another one.
    wider = Trainer(replace(cfg, out_dir=str(tmp_path / "b6"), init_from=str(tmp_path / "two"), num_layers=None,
                            block_size=6), tiny_target(), "fp", seqs)
    assert wider.drafter.config.block_size == 6
    with torch.no_grad():
        torch.testing.assert_close(block_outputs(wider.drafter), block_outputs(grown))


def test_epochs_are_permutations_in_batches_of_similar_length(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    seqs = [TokenSequence((1, 2), tuple(range(3, 3 + int(n)))) for n in torch.randint(2, 60, (64,), generator=g)]
    trainer = Trainer(config(tmp_path, heldout_fraction=0.0), tiny_target(), "fp", seqs)
    spread = []
    for epoch in (0, 1):
        order = trainer.data.epoch_order(epoch)
        assert sorted(order) == list(range(64))
        lengths = [len(seqs[i].response) for i in order]
        spread.append(max(max(lengths[b:b + 4]) - min(lengths[b:b + 4]) for b in range(0, 64, 4)))
    assert trainer.data.epoch_order(0) != trainer.data.epoch_order(1) and max(spread) < 15, spread


def test_each_evaluation_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="specloop.daemon.training.heldout"):
        Trainer(config(tmp_path, max_steps=20, eval_tau=True), tiny_target(), "fp", cycling(20)).run()
    lines = [r.getMessage() for r in caplog.records if r.name == "specloop.daemon.training.heldout"]
    assert [line.split(" (")[0] for line in lines] == ["step 10", "step 20"]
    assert all("held-out loss" in line and "tau" in line for line in lines)


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
    assert len(cached.features.store) == 8 and not len(fresh.features.store)
    for (name, a), b in zip(cached.drafter.state_dict().items(), fresh.drafter.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_a_later_run_reads_features_from_disk_instead_of_running_the_target(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seqs, target = cycling(8), tiny_target()
    first = Trainer(config(tmp_path / "a", max_steps=4, heldout_fraction=0.0, feature_cache_gb=0.0,
                           feature_dir=str(tmp_path / "features")), target, "fp", seqs)
    first.advance(4)
    assert len(list((tmp_path / "features").glob("*.safetensors"))) == 8

    import specloop.daemon.training.target_features as target_features
    passes = []
    real = target_features.target_features
    monkeypatch.setattr(target_features, "target_features", lambda *a, **kw: passes.append(1) or real(*a, **kw))
    again = Trainer(config(tmp_path / "b", max_steps=4, heldout_fraction=0.0, feature_cache_gb=0.0,
                           feature_dir=str(tmp_path / "features")), target, "fp", seqs)
    again.advance(4)
    assert not passes and again.features.store.disk_hits == 16 and again.features.store.misses == 0
    for (name, a), b in zip(first.drafter.state_dict().items(), again.drafter.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    # Features of another base model are not these: the fingerprint is part of the key.
    other = Trainer(config(tmp_path / "c", max_steps=1, heldout_fraction=0.0, feature_dir=str(tmp_path / "features")),
                    target, "fp-other", seqs)
    other.advance(1)
    assert len(passes) == 4 and other.features.store.disk_hits == 0
    result = Trainer(config(tmp_path / "d", max_steps=2, heldout_fraction=0.0, feature_cache_gb=0.0,
                            feature_dir=str(tmp_path / "features")), target, "fp", seqs).run()
    assert result.features == {"computed": 0, "read_from_disk": 8, "evicted_from_disk": 0}


def test_heldout_tau_is_tracked_and_rises_with_training(tmp_path: Path) -> None:
    result = Trainer(config(tmp_path, eval_tau=True), tiny_target(), "fp", cycling(40)).run()
    taus = [point["heldout_tau"] for point in result.history]
    seen = [point["response_tokens_seen"] for point in result.history]
    assert 1.0 <= taus[0] < taus[-1] and taus[-1] > 2.0, taus
    assert seen == sorted(seen) and seen[-1] == 40 * 4 * 24  # 40 steps of 4 sequences of 24 response tokens


def test_feature_dir_cap_needs_a_directory_and_a_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="feature_dir_gb needs a feature_dir"):
        config(tmp_path, feature_dir_gb=10.0)
    with pytest.raises(ValueError, match="feature_dir_gb"):
        config(tmp_path, feature_dir=str(tmp_path / "f"), feature_dir_gb=0.0)
    assert config(tmp_path, feature_dir=str(tmp_path / "f"), feature_dir_gb=0.5).feature_dir_gb == 0.5

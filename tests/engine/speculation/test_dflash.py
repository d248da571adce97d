"""DFlash drafter: tap spreading, block masks, context causality, serving path equals training path."""

import pytest
import torch

from specloop.engine.speculation.dflash import DFlashConfig, SeparateBlocks, block_mask, context_mask, spread_tap_layers
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(60)


def test_tap_layers_spread_like_reference() -> None:
    assert spread_tap_layers(30, 5) == (1, 8, 14, 20, 27)
    assert spread_tap_layers(30, 1) == (15,)
    with pytest.raises(ValueError, match="num_taps"):
        spread_tap_layers(30, 0)


def test_config_rejects_bad_fields() -> None:
    target = tiny_target()
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig.for_target(target.config, block_size=1)
    with pytest.raises(ValueError, match="tap_layers"):
        DFlashConfig(**{**DFlashConfig.for_target(target.config).to_json(), "tap_layers": (3, 1)})


def test_block_mask_sees_context_before_anchor_and_own_block() -> None:
    anchors = torch.tensor([[2, 5]])
    keep = torch.tensor([[True, True]])
    m = block_mask(anchors, keep, ctx_len=8, block_size=3)[0, 0]  # [6, 8 + 6]
    assert m.shape == (6, 14)
    assert m[:3, :8].sum(dim=1).tolist() == [2, 2, 2]  # block 0: context 0, 1
    assert m[3:, :8].sum(dim=1).tolist() == [5, 5, 5]  # block 1: context 0..4
    assert m[:3, 8:11].all() and not m[:3, 11:].any()  # own block both ways, never the other one
    assert m[3:, 11:].all() and not m[3:, 8:11].any()


def _proposer(block_size: int | None = None) -> tuple[DFlashProposer, torch.Tensor, list[torch.Tensor]]:
    target = tiny_target()
    prop = DFlashProposer(tiny_drafter(target, block_size=4), target, block_size)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    _, taps = target(tokens, taps=prop.tap_layers)
    prop.allocate(4, 64)
    return prop, tokens, taps


def test_propose_shapes_and_lowered_block_size() -> None:
    prop, tokens, taps = _proposer(block_size=3)
    prop.observe([0, 1], [0, 0], taps, tokens)
    drafts = prop.propose([0, 1], [10, 15], tokens[:, 9], [tokens[0, :11].tolist(), tokens[1, :16].tolist()])
    assert drafts.shape == (2, 2) and drafts.dtype == torch.long
    with pytest.raises(ValueError, match="block_size"):
        DFlashProposer(prop.drafter, prop.target, block_size=5)


def test_drafts_ignore_context_at_and_after_the_anchor() -> None:
    prop, tokens, taps = _proposer()
    prop.observe([0], [0], [t[:1] for t in taps], tokens[:1])
    before = prop.block_logits([0], [10], tokens[0, 10:11])
    # Overwrite positions 10.. with other features: dead rows the engine may leave behind.
    prop.observe([0], [10], [torch.randn_like(t[:1, 10:]) for t in taps], tokens[:1, 10:])
    after = prop.block_logits([0], [10], tokens[0, 10:11])
    assert torch.equal(before, after)
    prop.observe([0], [5], [torch.randn_like(t[:1, 5:]) for t in taps], tokens[:1, 5:])
    assert not torch.allclose(before, prop.block_logits([0], [10], tokens[0, 10:11]))


def test_held_rows_are_written_as_each_observe_would_have_written_them() -> None:
    """Observed rows are held until a block is drafted from their slot: a verify block's rejected tail,
    replaced from the next step's start, and a slot's next sequence, starting again at 0, are written
    as if every observe had written at once."""
    lazy, tokens, taps = _proposer()
    eager = DFlashProposer(lazy.drafter, lazy.target)
    eager.allocate(4, 64)
    g = torch.Generator().manual_seed(7)

    def both(slots: list[int], starts: list[int], n: int) -> None:
        parts = [torch.randn(len(slots), n, t.shape[-1], generator=g) for t in taps]
        block = torch.zeros(len(slots), n, dtype=torch.long)
        lazy.observe(slots, starts, parts, block)
        eager.observe(slots, starts, parts, block)
        eager.write()

    both([0, 1], [0, 0], 12)  # prompts
    both([0, 1], [12, 12], 1)  # two plain decode steps (no draft, or proposing skipped)
    both([0, 1], [13, 13], 1)
    both([0, 1], [14, 14], 4)  # a verify block each: row 0 commits 3 positions, row 1 one
    both([0, 1], [17, 15], 4)
    both([1], [0], 6)  # slot 1's next sequence
    slots, lens, last = [0, 1], [19, 6], torch.tensor([3, 5])
    torch.testing.assert_close(lazy.block_logits(slots, lens, last), eager.block_logits(slots, lens, last),
                               atol=1e-5, rtol=1e-5)
    for got, want in ((lazy.cache.k, eager.cache.k), (lazy.cache.v, eager.cache.v)):
        torch.testing.assert_close(got[:, 0, :, :21], want[:, 0, :, :21], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:, 1, :, :6], want[:, 1, :, :6], atol=1e-5, rtol=1e-5)
    lazy.observe([2], [0], [t[:1, :5] for t in taps], tokens[:1, :5])
    lazy.release(2, tokens[0, :5].tolist())  # a finished sequence's held rows are dropped, never written
    lazy.write()
    assert not lazy.cache.k[:, 2].any()


def test_ragged_batch_matches_rows_alone() -> None:
    prop, tokens, taps = _proposer()
    prop.observe([2, 0], [0, 0], taps, tokens)
    both = prop.block_logits([2, 0], [7, 13], torch.stack([tokens[0, 7], tokens[1, 13]]))
    alone = prop.block_logits([0], [13], tokens[1, 13:14])
    torch.testing.assert_close(both[1:], alone, atol=1e-5, rtol=1e-5)


def test_serving_path_equals_training_path() -> None:
    """The many-anchor training forward gives each block the logits serving would draft with."""
    prop, tokens, taps = _proposer()
    d, target = prop.drafter, prop.target
    prop.observe([0], [0], [t[:1] for t in taps], tokens[:1])
    S = tokens.shape[1]
    anchors = torch.tensor([[4, 9, 15]])
    fused = d.fuse([t[:1] for t in taps])
    ctx = d.context_kv(fused, torch.arange(S).view(1, -1))
    x = d.embed_block(tokens[:1].gather(1, anchors), 4, target.embed)
    positions = (anchors.unsqueeze(-1) + torch.arange(4)).view(1, -1)
    hidden = d.run_blocks(x, positions, ctx, block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), S, 4))
    train_logits = target.logits(hidden.view(3, 4, -1)[:, 1:])
    for j, p in enumerate(anchors[0].tolist()):
        serve = prop.block_logits([0], [p], tokens[0, p:p + 1])[0]
        torch.testing.assert_close(train_logits[j], serve, atol=1e-4, rtol=1e-4)


def test_separate_blocks_equal_the_dense_training_mask() -> None:
    """The training attention without block-to-block scores gives what the dense mask gives, with
    ragged anchors, a dropped block (it sees only itself) and gradients."""
    target = tiny_target()
    d = tiny_drafter(target, block_size=4)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))
    _, taps = target(tokens, taps=d.config.tap_layers)
    S = tokens.shape[1]
    anchors, keep = torch.tensor([[1, 6, 12], [3, 9, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    positions = (anchors.unsqueeze(-1) + torch.arange(4)).view(2, -1)

    def run(mask: torch.Tensor | SeparateBlocks) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = d.context_kv(d.fuse([t.detach() for t in taps]), torch.arange(S).expand(2, S))
        hidden = d.run_blocks(d.embed_block(tokens.gather(1, anchors), 4, target.embed), positions, ctx, mask)
        return hidden, torch.autograd.grad(hidden.square().sum(), d.fc.weight)[0]

    dense, g_dense = run(block_mask(anchors, keep, S, 4))
    sparse, g_sparse = run(SeparateBlocks(context_mask(anchors, keep, S, 4), 4))
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_sparse, g_dense, atol=1e-4, rtol=1e-4)

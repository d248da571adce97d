"""Draft acceptance alone: how many drafts each row keeps (accept while equal, capped by `allowed`)
and what it commits (the kept drafts plus the target's bonus token, 1 to k+1 tokens)."""

import pytest
import torch

from specloop.engine.speculation.verify import accept_lengths, committed_tokens

pytestmark = pytest.mark.timeout(30)


def accept(drafts: list[list[int]], target: list[list[int]], allowed: list[int]) -> tuple[list[int], list[list[int]]]:
    d, t = torch.tensor(drafts, dtype=torch.long), torch.tensor(target, dtype=torch.long)
    n = accept_lengths(d, t, torch.tensor(allowed, dtype=torch.long))
    assert n.shape == (len(drafts),) and n.dtype == torch.long
    return n.tolist(), committed_tokens(d, t, n)


def test_all_drafts_accepted_commits_them_and_the_bonus() -> None:
    assert accept([[5, 6, 7]], [[5, 6, 7, 8]], [3]) == ([3], [[5, 6, 7, 8]])


def test_no_draft_accepted_commits_the_target_token() -> None:
    assert accept([[5, 6, 7]], [[4, 6, 7, 9]], [3]) == ([0], [[4]])


def test_later_matches_after_a_mismatch_do_not_count() -> None:
    # d1 matches, d2 does not; d3 and d4 match their positions but follow a rejected draft.
    assert accept([[5, 6, 7, 8]], [[5, 9, 7, 8, 1]], [4]) == ([1], [[5, 9]])


def test_each_row_is_judged_on_its_own() -> None:
    drafts = [[5, 6, 7], [5, 6, 7], [1, 2, 3], [1, 2, 3]]
    target = [[5, 6, 7, 8], [4, 6, 7, 9], [1, 0, 3, 3], [1, 2, 9, 9]]
    assert accept(drafts, target, [3, 3, 3, 3]) == ([3, 0, 1, 2], [[5, 6, 7, 8], [4], [1, 0], [1, 2, 9]])


def test_allowed_caps_the_accepted_drafts() -> None:
    drafts = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 9, 7]]
    target = [[5, 6, 7, 8]] * 4
    # Capped at 1 the bonus is the target's token after d1, which here equals d2.
    n, committed = accept(drafts, target, [1, 0, 2, 3])
    assert n == [1, 0, 2, 1]
    assert committed == [[5, 6], [5], [5, 6, 7], [5, 6]]


def test_no_drafts_commits_one_token() -> None:
    drafts = torch.zeros(2, 0, dtype=torch.long)
    target = torch.tensor([[4], [9]])
    n = accept_lengths(drafts, target, torch.tensor([0, 0]))
    assert n.tolist() == [0, 0]
    assert committed_tokens(drafts, target, n) == [[4], [9]]


def test_shapes_are_checked() -> None:
    drafts = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(AssertionError):
        accept_lengths(drafts, torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 2]))  # target needs k+1
    with pytest.raises(AssertionError):
        accept_lengths(drafts, torch.tensor([[1, 2, 3]]), torch.tensor([2]))  # one target row for two
    with pytest.raises(AssertionError):
        accept_lengths(drafts, torch.tensor([[1, 2, 3], [3, 4, 5]]), torch.tensor([2, 2, 2]))


def test_committed_tokens_are_the_targets_own_and_maximal() -> None:
    """Over random blocks from a 3-token vocabulary (so partial accepts are common): every committed
    token is the target's token at its position, there are 1 to k+1 of them, and no longer prefix
    of drafts would also have matched within `allowed`."""
    gen = torch.Generator().manual_seed(0)
    B, k = 300, 4
    target = torch.randint(0, 3, (B, k + 1), generator=gen)
    keep = torch.rand(B, k, generator=gen) < 0.7
    drafts = torch.where(keep, target[:, :k], torch.randint(0, 3, (B, k), generator=gen))
    allowed = torch.randint(0, k + 1, (B,), generator=gen)
    n = accept_lengths(drafts, target, allowed)
    committed = committed_tokens(drafts, target, n)
    seen = set()
    for b in range(B):
        nb, cap = int(n[b]), int(allowed[b])
        assert 0 <= nb <= cap
        assert 1 <= len(committed[b]) == nb + 1 <= k + 1
        assert committed[b] == target[b, :nb + 1].tolist()
        assert drafts[b, :nb].tolist() == target[b, :nb].tolist()
        if nb < cap:
            assert int(drafts[b, nb]) != int(target[b, nb])
        seen.add(nb)
    assert seen == set(range(k + 1))  # every accept length actually occurred

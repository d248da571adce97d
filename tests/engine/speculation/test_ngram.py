"""N-gram prompt lookup: longest suffix match, latest occurrence, fixed draft count."""

import pytest
import torch

from specloop.engine.speculation.ngram import NgramProposer, lookup

pytestmark = pytest.mark.timeout(30)


def test_lookup_prefers_longest_then_latest_match() -> None:
    history = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurs at 0 (followed by 9); the 2-gram "2 3" also occurs later, but the 3-gram wins.
    assert lookup(history, 3, max_ngram=3, min_ngram=1) == ([9, 2, 3], 3)
    # With 2-grams at most, the latest "2 3" (followed by 7 8) wins.
    assert lookup(history, 2, max_ngram=2, min_ngram=1) == ([7, 8], 2)


def test_lookup_without_match_and_never_matching_itself() -> None:
    assert lookup([5, 6, 7], 4, max_ngram=3, min_ngram=1) == ([], 0)
    assert lookup([4], 4, max_ngram=3, min_ngram=1) == ([], 0)
    assert lookup([4, 4], 4, max_ngram=3, min_ngram=1) == ([4], 1)


def test_proposer_always_returns_k_drafts_and_reports_matches() -> None:
    p = NgramProposer(block_size=4, max_ngram=2)
    drafts = p.propose([0, 1], [5, 2], torch.tensor([3, 9]), [[1, 2, 3, 1, 2], [8, 9]])
    assert drafts.tolist() == [[3, 1, 2], [9, 9, 9]]
    assert p.last_scores == [2, 0]
    assert p.tap_layers == ()


def test_proposer_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="block_size"):
        NgramProposer(block_size=1)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer(max_ngram=2, min_ngram=3)

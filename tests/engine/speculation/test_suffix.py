"""Suffix decoding's drafting rule on hand-made histories: the most frequent continuation, drafts as
long as the match and its agreement allow, a namespace's cache only for that namespace."""

import numpy as np
import pytest
import torch

from specloop.engine.speculation.proposer import NO_DRAFT
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer, own_context_draft, walk
from specloop.engine.speculation.suffix_cache import Match, SuffixCache


def match(doc: list[int], ends: list[int], length: int) -> Match:
    return Match(np.asarray(doc, dtype=np.int32), np.asarray(ends), length)


def test_walk_follows_the_most_frequent_continuation_while_it_is_likely() -> None:
    # After "1": "2 3" twice, "2 4" once, "5" once.
    doc = [1, 2, 3, -1, 1, 2, 3, -1, 1, 2, 4, -1, 1, 5, -1]
    draft = walk(match(doc, [0, 4, 8, 12], 1), k=4, min_prob=0.1)
    assert draft.tokens == [2, 3]  # then every continuation ends at its document's separator
    assert draft.score == pytest.approx(3 / 4 + 2 / 4)
    assert walk(match(doc, [0, 4, 8, 12], 1), k=4, min_prob=0.6).tokens == [2]


def reference_walk(doc: list[int], ends: list[int], k: int, min_prob: float, prior: float) -> tuple[list, list]:
    """The rule as written in the module docstring, one column at a time over every occurrence."""
    conts = [[doc[e + 1 + j] if e + 1 + j < len(doc) else -1 for j in range(k)] for e in ends]
    conts = [c[:c.index(-1)] + [-1] * (k - c.index(-1)) if -1 in c else c for c in conts]
    alive, tokens, probs, prob = conts, [], [], 1.0
    for j in range(k):
        column = [c[j] for c in alive]
        counted = sorted({t for t in column if t != -1})
        if not counted:
            break
        best = max(counted, key=lambda t: (column.count(t), -t))  # the most frequent; the smallest of a tie
        prob *= column.count(best) / (len(column) + prior)
        if prob < min_prob:
            break
        tokens.append(best)
        probs.append(prob)
        alive = [c for c in alive if c[j] == best]
    return tokens, probs


@pytest.mark.parametrize("seed", range(20))
def test_walk_equals_the_rule_on_random_occurrences(seed: int) -> None:
    rng = np.random.default_rng(seed)
    doc = rng.integers(-1, 4, 300).tolist()  # few tokens: ties and shared continuations are common
    ends = sorted(rng.choice(300, int(rng.integers(1, 65)), replace=False).tolist())
    k, min_prob, prior = int(rng.integers(1, 16)), float(rng.choice([0.05, 0.1, 0.5])), float(rng.choice([0, 1]))
    draft = walk(match(doc, ends, 1), k, min_prob, prior)
    assert (draft.tokens, draft.probs) == reference_walk(doc, ends, k, min_prob, prior)


def test_spec_factor_bounds_the_draft_by_the_match_length() -> None:
    history = np.array([7, 8, 1, 2, 3, 4, 5, 6, 9, 8], dtype=np.int32)  # "8" seen before: a 1-token match
    assert own_context_draft(history, SuffixConfig(min_match=1, spec_factor=1.0), k=6).tokens == [1]
    assert own_context_draft(history, SuffixConfig(min_match=1, spec_factor=3.0), k=6).tokens == [1, 2, 3]
    assert own_context_draft(history, SuffixConfig(min_match=2), k=6).tokens == []


def test_rows_without_a_match_draft_nothing_and_the_rest_end_in_no_draft() -> None:
    p = SuffixProposer(SuffixConfig(block_size=6))
    drafts = p.propose([0, 1], [7, 4], torch.tensor([3, 9]), [[1, 2, 3, 4, 5, 1, 2, 3], [6, 7, 8, 9]])
    assert drafts.tolist() == [[4, 5, 1, NO_DRAFT, NO_DRAFT], [NO_DRAFT] * 5]
    assert p.last_scores == [3.0, 0.0]


def test_finished_requests_feed_only_their_own_namespace() -> None:
    cache = SuffixCache()
    p = SuffixProposer(SuffixConfig(block_size=5), cache)
    p.begin(0, "acme")
    p.release(0, [10, 11, 12, 13, 14, 15])
    p.begin(1, None)  # a tenant that turned the cache off: neither reads nor adds
    p.release(1, [20, 21, 22, 23])
    assert set(cache.histories) == {"acme"} and cache.size == 7
    for slot, namespace in enumerate(["acme", "other", None]):
        p.begin(slot, namespace)
    drafts = p.propose([0, 1, 2], [2, 2, 2], torch.tensor([12, 12, 12]), [[11, 12]] * 3)
    assert drafts.tolist() == [[13, 14, NO_DRAFT, NO_DRAFT], [NO_DRAFT] * 4, [NO_DRAFT] * 4]


def test_config_refuses_nonsense() -> None:
    for bad in ({"block_size": 1}, {"min_match": 0}, {"min_match": 9, "max_match": 8}, {"min_prob": 0.0},
                {"spec_factor": 0.0}, {"max_candidates": 0}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)

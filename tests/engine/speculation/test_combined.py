"""The combined proposer's routing: lookup drafts (n-gram, suffix decoding) for rows it is confident
about, the drafter's elsewhere."""

import pytest
import torch

from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import NO_DRAFT, StatelessProposer
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer


class Constant(StatelessProposer):
    def __init__(self, token: int, block_size: int) -> None:
        self.token, self.block_size = token, block_size

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        return torch.full((len(slots), self.num_drafts), self.token)


@pytest.mark.parametrize("min_match, expected", [(1, [[9, 1, 2], [7, 9, 5]]), (3, [[9, 1, 2], [0, 0, 0]])])
def test_combined_takes_ngram_only_for_matches_of_min_match_tokens(min_match: int, expected: list) -> None:
    # Row 0 ends in "1 2 3", seen before (a 3-token match); row 1 ends in "5", seen once (1 token).
    histories = [[1, 2, 3, 9, 1, 2, 3], [5, 7, 9, 5]]
    both = CombinedProposer(Constant(0, 4), NgramProposer(block_size=4), min_match)  # type: ignore[arg-type]
    drafts = both.propose([0, 1], [6, 3], torch.tensor([3, 5]), histories)
    assert drafts.tolist() == expected


def test_combined_with_suffix_decoding_routes_by_score_and_pads_the_shorter_block() -> None:
    # Row 0 ends in "1 2 3", seen before (suffix decoding drafts "9 1 2", score 3); row 1 has no match.
    histories = [[1, 2, 3, 9, 1, 2, 3], [5, 7, 9, 6]]
    suffix = SuffixProposer(SuffixConfig(block_size=6))
    both = CombinedProposer(Constant(0, 3), suffix, min_score=1.0)  # type: ignore[arg-type]
    assert both.block_size == 6
    drafts = both.propose([0, 1], [6, 3], torch.tensor([3, 6]), histories)
    assert drafts.tolist() == [[9, 1, 2, NO_DRAFT, NO_DRAFT], [0, 0, NO_DRAFT, NO_DRAFT, NO_DRAFT]]
    assert both.last_learned == [1]


def test_below_min_score_the_draft_expected_to_go_further_wins() -> None:
    # Both rows fall below min_score 4, so DFlash drafts both. Row 0's suffix draft expects 3 accepted:
    # a DFlash that expects 2 (block 3, certain) loses it, one that expects 5 (block 6) takes it.
    histories = [[1, 2, 3, 9, 1, 2, 3], [5, 7, 9, 6]]
    suffix = SuffixProposer(SuffixConfig(block_size=6))
    short = CombinedProposer(Constant(0, 3), suffix, min_score=4.0)  # type: ignore[arg-type]
    drafts = short.propose([0, 1], [6, 3], torch.tensor([3, 6]), histories)
    assert drafts.tolist() == [[9, 1, 2, NO_DRAFT, NO_DRAFT], [0, 0, NO_DRAFT, NO_DRAFT, NO_DRAFT]]
    long = CombinedProposer(Constant(0, 6), suffix, min_score=4.0)  # type: ignore[arg-type]
    assert long.propose([0, 1], [6, 3], torch.tensor([3, 6]), histories).tolist() == [[0] * 5, [0] * 5]
    # Counted over every call: rows proposed for, asked of DFlash, given DFlash's draft.
    assert (short.rows_proposed, short.rows_asked, short.rows_learned) == (2, 2, 1)
    short.propose([0, 1], [6, 3], torch.tensor([3, 6]), histories)
    assert (short.rows_proposed, short.rows_asked, short.rows_learned) == (4, 4, 2)
    assert (long.rows_proposed, long.rows_asked, long.rows_learned) == (2, 2, 2)


def test_suffix_decoding_learns_only_from_the_rows_it_drafted() -> None:
    # Row 0: suffix decoding's draft "9 1 2" (score 3); row 1: no match, DFlash's draft. Told both rows
    # verified 2 drafts and accepted 1, suffix decoding counts row 0's two drafts only.
    histories = [[1, 2, 3, 9, 1, 2, 3], [5, 7, 9, 6]]
    suffix = SuffixProposer(SuffixConfig(block_size=6))
    both = CombinedProposer(Constant(0, 3), suffix, min_score=1.0)  # type: ignore[arg-type]
    both.propose([0, 1], [6, 3], torch.tensor([3, 6]), histories)
    assert both.last_taken == {1}
    both.verified([2, 2], [1, 1])
    assert suffix.calibration.verified.sum() == 2 and suffix.calibration.accepted.sum() == 1

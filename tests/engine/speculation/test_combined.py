"""The combined proposer's routing: n-gram drafts for rows with a long enough match, the drafter's elsewhere."""

import pytest
import torch

from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import StatelessProposer


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

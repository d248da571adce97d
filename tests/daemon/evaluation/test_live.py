"""τ by real speculative generation, checked against replay on the target's stored greedy outputs."""

import pytest

from specloop.daemon.evaluation.live import generate_stats
from specloop.daemon.evaluation.replay import replay
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from tests.dflash_helpers import greedy_outputs, tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(60)


def test_real_generation_reproduces_stored_greedy_outputs_and_replay_tau() -> None:
    target = tiny_target()
    seqs = greedy_outputs(target, [(1, 2, 3, 1, 2, 3, 1, 2), (5, 6, 7, 5, 6), (9, 9, 9)], max_tokens=20)
    for proposer in (NgramProposer(block_size=4), DFlashProposer(tiny_drafter(target, block_size=4), target)):
        live = generate_stats(target, proposer, seqs, concurrency=2)
        assert live["identical_to_stored"] == 3 and live["generated_tokens"] == 60
        replayed = replay(proposer, seqs, target)
        # Replay may count one more accepted draft on a sequence's last step (it has no room cap),
        # so the two agree up to the last step of each of the 3 sequences.
        assert abs(live["accepted_draft_tokens"] - replayed.accepted) <= 3
        assert live["verify_steps"] <= replayed.steps

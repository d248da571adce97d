"""Replay τ: hand-built cases with known answers, the DFlash and combined proposers run through
replay, and `compare` with real generation per contender and its refusals up front."""

from pathlib import Path

import pytest
import torch

import specloop.daemon.evaluation.replay as replay_module
from specloop.daemon.evaluation.replay import compare, replay
from specloop.daemon.evaluation.step_cost import HeldRows, Linear, PassCost, StepCost
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import StatelessProposer
from specloop.storage.sequences import TokenSequence
from tests.dflash_helpers import greedy_outputs, tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(60)


class Scripted(StatelessProposer):
    """Drafts the true continuation for the first `right` positions and a wrong token after them."""

    def __init__(self, truth: list[list[int]], block_size: int, right: int) -> None:
        self.truth, self.block_size, self.right = truth, block_size, right

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        rows = []
        for slot, h in zip(slots, histories, strict=True):
            nxt = self.truth[slot][len(h):len(h) + self.num_drafts]
            nxt = nxt + [-1] * (self.num_drafts - len(nxt))
            rows.append([t if i < self.right else -1 for i, t in enumerate(nxt)])
        return torch.tensor(rows)


class Confident(Scripted):
    """Scripted drafts, each scored above any combined proposer's `min_score`."""

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        self.last_scores = [float("inf")] * len(slots)
        return super().propose(slots, ctx_lens, last_tokens, histories)


SEQS = [TokenSequence((1, 2), tuple(range(10, 21))), TokenSequence((3,), (30, 31, 32, 33, 34))]


def test_perfect_drafts_commit_whole_blocks() -> None:
    stats = replay(Scripted([s.tokens for s in SEQS], 4, right=3), SEQS, batch_size=2)
    # Seq 0: 10 tokens after the prefill token -> steps of 4, 4, 2. Seq 1: 4 tokens -> one step of 4.
    assert (stats.steps, stats.committed) == (4, 14)
    assert stats.tau == 3.5
    # Seq 0's last step accepts both drafts the response still holds, but commits only those 2 tokens
    # (no bonus past the end), so it counts 1 accepted draft, as serving does: τ = 1 + 10 / 4.
    assert stats.accepted_per_position == (4, 3, 3)
    assert 1 + stats.accepted / stats.steps == stats.tau


def test_wrong_drafts_give_tau_one() -> None:
    stats = replay(Scripted([s.tokens for s in SEQS], 4, right=0), SEQS, batch_size=1)
    assert stats.tau == 1.0 and stats.steps == 14 and stats.acceptance_rate == 0.0


def line(fixed_s: float, per_position_s: float) -> PassCost:
    """A pass measured at 1 and 1,000 positions on the line `fixed + per position`."""
    return PassCost(((1, fixed_s + per_position_s), (1000, fixed_s + 1000 * per_position_s)))


def test_modelled_seconds_follow_the_width_verified_and_are_shared_by_the_step() -> None:
    # A step costs 1 s plus 1 s per verified position; both sequences run in one group.
    cost = StepCost(target=line(1.0, 1.0), lookup=Linear(0.0, 0.0))
    stats = replay(Scripted([s.tokens for s in SEQS], 4, right=3), SEQS, batch_size=2, cost=cost)
    # Prefill: one pass over each prompt (2 and 1 tokens): 3 s and 2 s. Step 1: both rows, width 4 (3
    # drafts + last token): 1 + 8 s, shared. Seq 1 is then done (4 tokens); seq 0 takes two more steps
    # alone, of widths 4 (1 + 4 s) and 3 (two drafts left: 1 + 3 s).
    assert stats.steps_per_trace == (3, 1) and stats.tokens == (10, 4)
    assert stats.seconds == pytest.approx((3 + 4.5 + 5 + 4, 2 + 4.5))
    assert stats.tokens_per_s == pytest.approx(14 / 23)
    silent = replay(Scripted([s.tokens for s in SEQS], 4, right=0), SEQS, batch_size=2, cost=cost)
    # No drafts: width 1; 4 steps with both rows, then 6 alone; and the two prefills.
    assert sum(silent.seconds) == pytest.approx(4 * 3.0 + 6 * 2.0 + 5)


def test_a_prefill_costs_the_target_per_chunk_and_a_drafter_the_writes_past_what_it_holds() -> None:
    plain = StepCost(target=line(1.0, 0.01), lookup=Linear(0.0, 0.0))
    drafted = StepCost(target=line(1.0, 0.01), lookup=Linear(0.0, 0.0), dflash_write=line(0.5, 0.001),
                       dflash_propose=Linear(0.0, 0.0))
    # 300 prompt tokens: chunks of 128, 128 and 44, each a pass (1 s + 0.01 s a token).
    assert plain.prefill_seconds(300) == pytest.approx(3 + 3.0)
    # The drafter holds the first two chunks (256 positions, not over HELD_POSITIONS) and writes all
    # 300 with the third, in one call (0.5 s + 0.001 s a position).
    held = HeldRows()
    assert drafted.prefill_seconds(300, held, 0) == pytest.approx(3 + 3.0 + 0.5 + 0.3)
    assert drafted.prefill_seconds(200, held, 1) == pytest.approx(2 + 2.0) and held.take(1) == 200


def test_held_rows_follow_the_drafters_rule() -> None:
    held = HeldRows()
    assert held.observe(0, 0, 100) == 0 and held.observe(0, 100, 4) == 0
    assert held.observe(0, 102, 4) == 0  # two of the block's four were committed: the rest replaced
    assert held.take(0) == 106 and held.take(0) == 0
    assert held.observe(0, 106, 4) == 0 and held.observe(0, 108, 300) == 302  # past HELD_POSITIONS: written


def test_a_drafter_pays_its_writes_only_on_the_steps_it_drafts() -> None:
    # DFlash drafts every step: each step writes what the last one observed, one 4-wide block.
    target = tiny_target()
    seqs = [TokenSequence(tuple(range(1, 9)), tuple(range(20, 40)))]
    write = line(1.0, 0.0)  # 1 s a call, whatever it writes
    cost = StepCost(target=line(0.0, 0.0), lookup=Linear(0.0, 0.0), dflash_write=write,
                    dflash_propose=Linear(0.0, 0.0))
    alone = replay(DFlashProposer(tiny_drafter(target, block_size=4), target), seqs, target, cost=cost)
    assert sum(alone.seconds) == pytest.approx(alone.steps)  # one write per step (the prompt's at the first)
    # DFlash drafts no step (every row's lookup score clears min_score): nothing is written.
    never = CombinedProposer(DFlashProposer(tiny_drafter(target, block_size=4), target),
                             Confident([s.tokens for s in seqs], 4, right=3), min_score=1.0)
    assert sum(replay(never, seqs, target, cost=cost).seconds) == 0.0


def test_partly_right_drafts() -> None:
    stats = replay(Scripted([s.tokens for s in SEQS], 4, right=1), SEQS)
    # Every step commits 2 (one draft + bonus) until the end: seq 0 needs 5 steps, seq 1 needs 2.
    assert (stats.steps, stats.committed, stats.accepted_per_position) == (7, 14, (7, 0, 0))
    assert stats.to_json()["per_position_acceptance"] == [1.0, 0.0, 0.0]


def test_ngram_replay_on_a_repetitive_answer() -> None:
    seq = TokenSequence((7, 1, 2, 3, 4, 5), (1, 2, 3, 4, 5, 9))
    stats = replay(NgramProposer(block_size=5, max_ngram=2), [seq])
    # Prefill commits 1; "1" is found in the prompt -> drafts 2 3 4 5, all right, bonus 9: one step.
    assert (stats.steps, stats.committed, stats.tau) == (1, 5, 5.0)


def test_dflash_and_combined_run_through_replay() -> None:
    target = tiny_target()
    dflash = DFlashProposer(tiny_drafter(target, block_size=4), target)
    seqs = [TokenSequence(tuple(range(1, 9)), tuple(range(20, 32))), TokenSequence((5, 6), (7, 8, 9))]
    alone = replay(dflash, seqs, target)
    assert 1.0 <= alone.tau <= 4.0 and alone.committed == 11 + 2
    combined = replay(CombinedProposer(dflash, NgramProposer(block_size=4)), seqs, target)
    assert combined.committed == alone.committed


def test_compare_adds_real_generation_per_contender() -> None:
    target = tiny_target()
    seqs = greedy_outputs(target, [(1, 2, 3, 1, 2, 3)], max_tokens=12)
    report = compare(target, "fp", seqs, [], ngram_block_size=4, live_concurrency=1)
    assert [r["kind"] for r in report["results"]] == ["ngram", "suffix"]
    for lookup in report["results"]:
        assert lookup["generation"]["identical_to_stored"] == 1 and lookup["generation"]["tau"] >= 1.0


def test_compare_refuses_a_missing_drafter_before_replaying_anything(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    replayed = []
    monkeypatch.setattr(replay_module, "replay", lambda proposer, *a, **k: replayed.append(proposer))
    seqs = [TokenSequence((1, 2, 3), (1, 2, 3))]
    with pytest.raises(ValueError, match="missing"):
        compare(tiny_target(), "fp", seqs, [tmp_path / "missing"], ngram_block_size=4)
    assert replayed == []

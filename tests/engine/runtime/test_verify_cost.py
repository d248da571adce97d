"""The verify width rule: draft columns are kept while what they are expected to add pays for the
positions they cost, for the whole batch."""

import pytest
import torch

from specloop.engine.speculation.proposer import Proposer, StatelessProposer
from specloop.engine.runtime.verify_cost import Linear, PassCost, WithStep, best_num_drafts, measure_pass, pass_shapes
from tests.engine.runtime.test_llm_engine import tiny


def test_free_positions_verify_every_draft_and_dear_ones_none() -> None:
    confidence = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.5, 0.0, 0.0, 0.0]])
    lengths = torch.tensor([4, 1])
    assert best_num_drafts(confidence, lengths, Linear(1.0, 0.0)) == 4
    assert best_num_drafts(confidence, lengths, Linear(1.0, 10.0)) == 0


def test_a_long_unlikely_tail_is_cut() -> None:
    # One row drafts 8 tokens, likely only for 2; seven rows draft nothing. A position costs a
    # hundredth of the pass, and every column is paid for by all 8 rows.
    confidence = torch.zeros(8, 8)
    confidence[0] = torch.tensor([0.95, 0.9, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
    lengths = torch.tensor([8] + [0] * 7)
    assert best_num_drafts(confidence, lengths, Linear(1.0, 0.01)) == 2
    assert best_num_drafts(confidence, lengths, Linear(1.0, 0.1)) == 0  # a tenth: not even those
    assert best_num_drafts(confidence, lengths, Linear(1.0, 0.0)) == 8


def test_the_rest_of_a_step_makes_wider_passes_relatively_cheaper() -> None:
    # 8 rows, first drafts at 0.9: a pass whose every position costs as much as a row's decode does not
    # pay for them; with 3 ms of the step outside an 18 ms pass (concurrency 8, `gguf`, Zen 3) it does.
    confidence, lengths = torch.full((8, 1), 0.9), torch.full((8,), 1)
    per_position = Linear(0.0, 0.018 / 8)
    assert best_num_drafts(confidence, lengths, per_position) == 0
    assert best_num_drafts(confidence, lengths, WithStep(per_position, 0.003)) == 1


def test_certain_drafts_are_all_verified_however_dear_a_wider_pass() -> None:
    """Proposers without estimates, and the canary's probes, verify every draft: with a price that
    steps up (as passes do) the rule would otherwise cut them, and τ would no longer be the drafter's."""
    steep = PassCost(((1, 0.010), (2, 0.011), (4, 0.040)))
    assert best_num_drafts(torch.ones(1, 3), torch.tensor([3]), steep) == 3
    assert best_num_drafts(torch.full((1, 3), 0.99), torch.tensor([3]), steep) == 1


def test_no_drafts_no_columns() -> None:
    assert best_num_drafts(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), Linear(1.0, 0.1)) == 0


def test_the_pass_is_measured_at_each_number_of_positions() -> None:
    cost = measure_pass(tiny(), pass_shapes(4, 8))
    assert pass_shapes(4, 8) == [(1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (4, 2), (4, 4), (4, 8)]
    assert [n for n, _ in cost.points] == [1, 2, 4, 8, 16, 32]  # 4 rows of 1 and 1 row of 4 averaged
    assert all(s > 0 for _, s in cost.points)


def test_a_pass_between_two_measured_ones_is_priced_between_and_past_them_along_the_last_two() -> None:
    cost = PassCost(((1, 0.010), (4, 0.016), (8, 0.022), (16, 0.038), (32, 0.066), (64, 0.057)))
    assert cost(1) == 0.010 and cost(2) == pytest.approx(0.012) and cost(12) == pytest.approx(0.030)
    assert cost(48) == pytest.approx(0.0615)  # a wider pass may cost less: another kernel takes it
    assert cost(128) == 0.057  # past the last, never falling
    assert torch.allclose(cost(torch.tensor([1.0, 2.0])), torch.tensor([0.010, 0.012], dtype=torch.float64))
    rising = PassCost(((1, 0.01), (2, 0.02)))
    assert rising(4) == pytest.approx(0.04) and not rising.free_positions
    assert PassCost(((1, 0.02), (2, 0.01))).free_positions
    assert PassCost.fit({(1, 4): 0.02, (4, 1): 0.04, (1, 1): 0.01}).points == ((1, 0.01), (4, pytest.approx(0.03)))


def flat(seconds: float) -> PassCost:
    """Measured beside a busy process: the widest pass no dearer than the narrowest."""
    return PassCost(((1, seconds), (64, seconds)))


def rising(seconds: float) -> PassCost:
    return PassCost(((1, seconds), (64, 4 * seconds)))


def test_a_fit_at_no_cost_per_position_is_measured_again_a_minute_later(monkeypatch) -> None:
    """Measured beside a busy process, the fit says positions are free; the engine measures again later,
    a bounded number of times, and keeps a fit that is not degenerate."""
    import specloop.engine.runtime.llm_engine as llm_engine
    from specloop.engine.runtime.llm_engine import REMEASURE_TRIES, EngineConfig, LLMEngine
    from specloop.engine.speculation.ngram import NgramProposer

    fits = iter([flat(0.5)] * REMEASURE_TRIES + [rising(0.01)])
    monkeypatch.setattr(llm_engine, "measure_pass", lambda *_: next(fits))
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=64), [], NgramProposer(block_size=4))
    assert engine.verify_cost == flat(0.5)  # measured at start, and not again within the minute
    for _ in range(REMEASURE_TRIES + 1):
        engine._verify_cost_at -= 61  # a minute on
        engine.verify_cost
    assert engine.verify_cost == flat(0.5) and next(fits) == rising(0.01)  # tries are bounded


def test_a_degenerate_fit_is_replaced_by_the_next_sound_one_which_is_kept(monkeypatch) -> None:
    import specloop.engine.runtime.llm_engine as llm_engine
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.speculation.ngram import NgramProposer

    fits = iter([flat(0.5), rising(0.01), rising(9.0)])
    monkeypatch.setattr(llm_engine, "measure_pass", lambda *_: next(fits))
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=64), [], NgramProposer(block_size=4))
    engine._verify_cost_at -= 61
    assert engine.verify_cost == rising(0.01)
    engine._verify_cost_at -= 61
    assert engine.verify_cost == rising(0.01)


def test_a_given_cost_is_kept_and_nothing_is_measured(monkeypatch) -> None:
    """Benchmarks comparing proposers give every engine one measurement; even a degenerate one is kept."""
    import specloop.engine.runtime.llm_engine as llm_engine
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.speculation.ngram import NgramProposer

    def measured(*_: object) -> PassCost:
        raise AssertionError("a given cost is not measured again")

    monkeypatch.setattr(llm_engine, "measure_pass", measured)
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=64), [], NgramProposer(block_size=4),
                       verify_cost=flat(0.5))
    engine._verify_cost_at -= 61
    assert engine.verify_cost == flat(0.5)


class Likely(StatelessProposer):
    """Drafts token 1 three times for every row, each estimated 0.9, and counts how often it is asked."""

    block_size = 4

    def __init__(self) -> None:
        self.asked = 0

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        self.asked += 1
        self.last_confidence = torch.full((len(slots), 3), 0.9)
        return torch.ones(len(slots), 3, dtype=torch.long)


def test_a_proposer_whose_likely_drafts_never_pay_is_asked_rarely_and_outputs_equal_plain() -> None:
    """Where every extra position costs as much as the pass (8 `gguf` rows on the Zen 3), likely drafts
    are still not verified; after UNPAID_STEPS such steps the proposer is asked only every
    UNPAID_PROBE-th step, and greedy answers are plain decoding's."""
    from specloop.engine.runtime.llm_engine import UNPAID_PROBE, UNPAID_STEPS, EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams

    model, prompts = tiny(), [[5, 6, 7, 5, 6, 7, 5, 6]] * 2
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [s.output_ids for s in LLMEngine(model, EngineConfig(num_slots=2, max_len=128), []).generate(prompts, greedy)]
    linear = PassCost(((1, 0.01), (2, 0.02), (64, 0.64)))  # each position as dear as a one-row pass
    proposer = Likely()
    out = LLMEngine(model, EngineConfig(num_slots=2, max_len=128), [], proposer, verify_cost=linear).generate(
        prompts, greedy)
    assert [s.output_ids for s in out] == plain and out[0].spec.drafts == 0
    assert UNPAID_STEPS <= proposer.asked <= UNPAID_STEPS + 40 // UNPAID_PROBE + 1 < 40 // 2  # of ~40 steps


class LikelyWatching(Proposer):
    """`Likely`'s drafts from a proposer that watches the target's hidden states as DFlash does: records
    each slot's observed rows and fails on a gap (a position no pass showed it)."""

    block_size = 4
    tap_layers = (0,)

    def __init__(self) -> None:
        self.asked = 0

    propose = Likely.propose

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.seen = {slot: 0 for slot in range(num_slots)}  # slot -> positions observed from 0 on

    def begin(self, slot: int, namespace: str | None) -> None:
        self.seen[slot] = 0

    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        assert len(taps) == 1 and taps[0].shape[:2] == token_ids.shape
        for slot, start in zip(slots, starts, strict=True):
            assert start <= self.seen[slot], f"slot {slot}: positions {self.seen[slot]}..{start - 1} never observed"
            self.seen[slot] = start + token_ids.shape[1]


def test_a_skipped_proposer_that_watches_hidden_states_still_sees_every_position() -> None:
    """DFlash (as in the combined proposer) keeps a context of the target's hidden states: a step
    that does not ask it still shows it its pass, so skipping leaves no gap in what it observed."""
    from specloop.engine.runtime.llm_engine import UNPAID_STEPS, EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams

    model, prompts = tiny(), [[5, 6, 7, 5, 6, 7, 5, 6]] * 2
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [s.output_ids for s in LLMEngine(model, EngineConfig(num_slots=2, max_len=128), []).generate(prompts, greedy)]
    linear = PassCost(((1, 0.01), (2, 0.02), (64, 0.64)))
    proposer = LikelyWatching()
    out = LLMEngine(model, EngineConfig(num_slots=2, max_len=128), [], proposer, verify_cost=linear).generate(
        prompts, greedy)
    assert [s.output_ids for s in out] == plain
    assert UNPAID_STEPS <= proposer.asked < 40 // 2
    assert all(seen >= len(prompts[0]) + 40 - 1 for seen in proposer.seen.values())


def test_a_proposer_whose_drafts_pay_is_asked_every_step() -> None:
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams

    proposer = Likely()
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=128), [], proposer, verify_cost=flat(0.01))
    out = engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]] * 2, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    # Free positions: every step verifies its drafts, but for the last ones, which the token budget cuts.
    assert 0 < out[0].spec.drafts <= proposer.asked <= out[0].spec.drafts + 2

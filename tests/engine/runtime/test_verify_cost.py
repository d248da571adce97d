"""The verify width rule: draft columns are kept while what they are expected to add pays for the
positions they cost, for the whole batch."""

import torch

from specloop.engine.runtime.verify_cost import Linear, best_num_drafts, measure_pass
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


def test_no_drafts_no_columns() -> None:
    assert best_num_drafts(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), Linear(1.0, 0.1)) == 0


def test_the_pass_is_measured_as_fixed_plus_per_position() -> None:
    cost = measure_pass(tiny(), [(1, 1), (1, 8), (4, 1), (4, 8)])
    assert cost.fixed_s > 0 and cost.per_unit_s >= 0


def test_a_fit_at_no_cost_per_position_is_measured_again_a_minute_later(monkeypatch) -> None:
    """Measured beside a busy process, the fit says positions are free; the engine measures again later,
    a bounded number of times, and keeps a fit that is not degenerate."""
    import specloop.engine.runtime.llm_engine as llm_engine
    from specloop.engine.runtime.llm_engine import REMEASURE_TRIES, EngineConfig, LLMEngine
    from specloop.engine.speculation.ngram import NgramProposer

    fits = iter([Linear(0.5, 0.0)] * REMEASURE_TRIES + [Linear(0.01, 0.001)])
    monkeypatch.setattr(llm_engine, "measure_pass", lambda *_: next(fits))
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=64), [], NgramProposer(block_size=4))
    assert engine.verify_cost == Linear(0.5, 0.0)  # measured at start, and not again within the minute
    for _ in range(REMEASURE_TRIES + 1):
        engine._verify_cost_at -= 61  # a minute on
        engine.verify_cost
    assert engine.verify_cost == Linear(0.5, 0.0) and next(fits) == Linear(0.01, 0.001)  # tries are bounded


def test_a_degenerate_fit_is_replaced_by_the_next_sound_one_which_is_kept(monkeypatch) -> None:
    import specloop.engine.runtime.llm_engine as llm_engine
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.speculation.ngram import NgramProposer

    fits = iter([Linear(0.5, 0.0), Linear(0.01, 0.001), Linear(9.0, 9.0)])
    monkeypatch.setattr(llm_engine, "measure_pass", lambda *_: next(fits))
    engine = LLMEngine(tiny(), EngineConfig(num_slots=2, max_len=64), [], NgramProposer(block_size=4))
    engine._verify_cost_at -= 61
    assert engine.verify_cost == Linear(0.01, 0.001)
    engine._verify_cost_at -= 61
    assert engine.verify_cost == Linear(0.01, 0.001)

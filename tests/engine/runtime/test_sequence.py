"""Per-sequence speculation counters: pooling several sequences' `SpecStats`."""

from specloop.engine.runtime.sequence import SpecStats


def test_pooled_spec_stats_sum_counters_and_positions() -> None:
    a, b = SpecStats(), SpecStats()
    a.record(3, 2)
    b.record(5, 4)
    b.record(5, 0)
    pooled = SpecStats.pooled([a, b])
    assert (pooled.drafts, pooled.draft_tokens, pooled.accepted_tokens) == (3, 13, 6)
    assert pooled.accepted_per_position == [2, 2, 1, 1, 0]
    assert pooled.mean_accepted_length == 3.0

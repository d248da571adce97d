"""The rollout verdict, every branch, judged from a real LiveTau on a SQLite file fed with the
cumulative counters an engine would export minute by minute."""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.live_tau import EngineSample, LiveTau, VersionCounters
from specloop.daemon.retrain.rollback import Promotion, RolloutDecision, RolloutVerdict, judge_rollout
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.retrain.watch import Watch

PROMOTED_AT = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
ENGINE = "http://engine-1:8000"


@dataclass(frozen=True)
class Rollout:
    watch_minutes: float = 30.0
    min_verify_steps: int = 100
    rollback_below: float = 0.9


ROLLOUT = Rollout()
PROMOTION = Promotion(version="v4", previous="v3", promoted_at=PROMOTED_AT)


def minutes(n: float) -> datetime:
    return PROMOTED_AT + timedelta(minutes=n)


class Traffic:
    """One engine's cumulative counters, recorded once a minute as it serves one version at a set τ."""

    def __init__(self, live: LiveTau) -> None:
        self.live = live
        self.counters: dict[str, VersionCounters] = {}

    def serve(self, version: str, tau: float, steps_per_min: int, from_min: int, to_min: int) -> None:
        self._record(version, from_min)
        for m in range(from_min + 1, to_min + 1):
            c = self.counters.get(version, VersionCounters(0, 0))
            self.counters[version] = VersionCounters(c.drafts + steps_per_min,
                                                     c.accepted_tokens + round(steps_per_min * (tau - 1)))
            self._record(version, m)

    def _record(self, serving: str, at_min: int) -> None:
        self.live.record([EngineSample(ENGINE, minutes(at_min), serving, dict(self.counters))])


@pytest.fixture
def traffic(tmp_path: Path) -> Traffic:
    return Traffic(LiveTau(open_state(f"sqlite:///{tmp_path}/state.db")))


def judge(traffic: Traffic, at_min: float, promotion: Promotion = PROMOTION,
          rollout: Rollout = ROLLOUT) -> RolloutDecision:
    return judge_rollout(promotion, rollout, traffic.live, now=minutes(at_min))


def test_too_few_verify_steps_keeps_watching(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=20, from_min=-30, to_min=0)
    traffic.serve("v4", tau=1.2, steps_per_min=20, from_min=0, to_min=4)
    v = judge(traffic, 4)
    assert v.verdict is RolloutVerdict.WATCH and not v.final
    assert v.new.drafts == 80 and v.baseline.drafts == 600
    assert "80 of 100 verify steps" in v.reason


def test_a_fall_below_the_floor_rolls_back_before_the_window_ends(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=20, from_min=-30, to_min=0)
    traffic.serve("v4", tau=2.5, steps_per_min=20, from_min=0, to_min=10)
    v = judge(traffic, 10)
    assert v.verdict is RolloutVerdict.ROLL_BACK and v.final
    assert v.new.tau == pytest.approx(2.5) and v.baseline.tau == pytest.approx(3.0)
    for words in ("v4 τ 2.500 over 200 verify steps", "v3 τ 3.000 over 600 verify steps", "2.700"):
        assert words in v.reason


def test_holding_tau_keeps_watching_until_the_window_ends_then_passes(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=20, from_min=-30, to_min=0)
    traffic.serve("v4", tau=2.8, steps_per_min=20, from_min=0, to_min=31)
    watching = judge(traffic, 10)
    assert watching.verdict is RolloutVerdict.WATCH and "holding so far" in watching.reason
    passed = judge(traffic, 30)
    assert passed.verdict is RolloutVerdict.PASSED and passed.final
    assert passed.new.drafts == 600 and "v4 τ 2.800" in passed.reason and "v3 τ 3.000" in passed.reason


def test_tau_exactly_at_the_floor_is_kept(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=100, from_min=-30, to_min=0)
    traffic.serve("v4", tau=1.5, steps_per_min=100, from_min=0, to_min=30)
    assert judge(traffic, 30, rollout=Rollout(rollback_below=0.5)).verdict is RolloutVerdict.PASSED


def test_the_baseline_is_only_the_watch_window_before_the_promotion(traffic: Traffic) -> None:
    traffic.serve("v3", tau=5.0, steps_per_min=20, from_min=-90, to_min=-31)  # long before: not compared
    traffic.serve("v3", tau=2.0, steps_per_min=20, from_min=-31, to_min=0)
    traffic.serve("v4", tau=2.0, steps_per_min=20, from_min=0, to_min=30)
    v = judge(traffic, 30)
    assert v.baseline.tau == pytest.approx(2.0) and v.baseline.drafts == 600
    assert v.verdict is RolloutVerdict.PASSED


def test_without_a_baseline_it_watches_then_passes_without_a_comparison(traffic: Traffic) -> None:
    traffic.serve("v4", tau=1.1, steps_per_min=20, from_min=0, to_min=30)
    watching = judge(traffic, 10)
    assert watching.verdict is RolloutVerdict.WATCH and watching.baseline is None
    assert "no baseline: v3 ran 0 of 100 verify steps" in watching.reason
    assert "passes when the window ends" in watching.reason
    done = judge(traffic, 30)
    assert done.verdict is RolloutVerdict.NO_BASELINE and done.final
    assert "passed without a comparison" in done.reason and "v4 τ 1.100 over 600" in done.reason


def test_a_baseline_with_too_few_steps_is_no_baseline(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=2, from_min=-30, to_min=0)
    traffic.serve("v4", tau=1.1, steps_per_min=20, from_min=0, to_min=30)
    v = judge(traffic, 30)
    assert v.verdict is RolloutVerdict.NO_BASELINE and v.baseline is None
    assert "v3 ran 60 of 100 verify steps" in v.reason


def test_after_the_window_too_few_steps_still_watches(traffic: Traffic) -> None:
    traffic.serve("v3", tau=3.0, steps_per_min=20, from_min=-30, to_min=0)
    traffic.serve("v4", tau=3.0, steps_per_min=1, from_min=0, to_min=45)
    v = judge(traffic, 45)
    assert v.verdict is RolloutVerdict.WATCH and "45 of 100 verify steps" in v.reason


def test_the_previous_version_may_be_ngram_lookup(traffic: Traffic) -> None:
    traffic.serve("none", tau=1.5, steps_per_min=20, from_min=-30, to_min=0)
    traffic.serve("v1", tau=1.2, steps_per_min=20, from_min=0, to_min=10)
    v = judge(traffic, 10, promotion=Promotion("v1", "none", PROMOTED_AT))
    assert v.verdict is RolloutVerdict.ROLL_BACK and "none τ 1.500" in v.reason


def test_bad_arguments_are_value_errors(traffic: Traffic) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        Promotion("v4", "v3", datetime(2025, 3, 1, 12))
    with pytest.raises(ValueError, match="replaces itself"):
        Promotion("v4", "v4", PROMOTED_AT)
    with pytest.raises(ValueError, match="before the promotion"):
        judge(traffic, -1)


def test_a_promotion_newer_than_the_watch_is_judged_next_time(traffic: Traffic) -> None:
    """In a fleet another daemon may promote between the moment a watch reads the clock and the moment
    it reads the history (seen: 0.86 s); that promotion waits for the next watch instead of failing it."""
    history = PromotionHistory(traffic.live.db)
    history.record("fp", Action.PROMOTED, "v4", "test", previous="v3", at=minutes(0))
    watch = Watch("fp", None, history, traffic.live, ROLLOUT, [])  # the registry is not reached
    assert watch.judge(minutes(-0.01)) is None
    assert watch.judge(minutes(1)).verdict is RolloutVerdict.WATCH

"""The pure decisions of the loop: the gate and the tick's triggers and cooldown."""

from datetime import UTC, datetime, timedelta

import pytest

from specloop.daemon.evaluation.speed_gain import SpeedGain
from specloop.daemon.retrain.gate import GateVerdict, decide
from specloop.daemon.retrain.policy import Gate, parse_policy
from specloop.daemon.retrain.triggers import Situation, decide_tick, first_drafter_due

FP, OTHER = "0123456789abcdef", "fedcba9876543210"
NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)


def gate(gain: float, low: float, required: float = 0.05, approval: bool = False, challenger_fp: str = FP):
    speed = SpeedGain(gain, low, gain + 0.1, 0.95, 40)
    return decide(Gate(min_relative_gain=required, require_approval=approval), served_base_model=FP,
                  challenger_base_model=challenger_fp, speed=speed, tau_challenger=2.2, tau_champion=2.0,
                  champion_label="v3")


def test_a_slower_or_barely_faster_challenger_is_refused() -> None:
    assert gate(-0.1, -0.2).verdict is GateVerdict.REFUSE
    barely = gate(0.045, 0.01)  # +4.5%, 5% needed
    assert barely.verdict is GateVerdict.REFUSE and "below the 5.0% required gain" in barely.reason
    assert ("+4.5% decode speed (95% CI +1.0% to +14.5%, 40 traces) over v3; τ 2.200 vs 2.000"
            in barely.reason)


def test_a_gain_within_noise_is_refused_with_that_reason() -> None:
    noisy = gate(0.12, -0.01)
    assert noisy.verdict is GateVerdict.REFUSE and "within noise" in noisy.reason


def test_a_faster_challenger_is_promoted_or_waits_for_approval() -> None:
    assert gate(0.12, 0.03).verdict is GateVerdict.PROMOTE
    waiting = gate(0.12, 0.03, approval=True)
    assert waiting.verdict is GateVerdict.AWAIT_APPROVAL and waiting.passed


def test_a_base_model_mismatch_is_refused_whatever_the_speed() -> None:
    refused = gate(1.0, 0.9, challenger_fp=OTHER)
    assert refused.verdict is GateVerdict.REFUSE and "base model mismatch" in refused.reason and OTHER in refused.reason


POLICY = parse_policy("""
schedule: {interval_minutes: 5}
triggers: {min_new_traces: 100, max_champion_age_hours: 24, live_tau_below: 2.0}
cooldown_minutes: 30
""")


def situation(new: int = 0, age_h: float = 1, live: float | None = 2.5, moved_min_ago: float | None = None):
    return Situation(NOW, new, NOW - timedelta(hours=age_h), live,
                     None if moved_min_ago is None else NOW - timedelta(minutes=moved_min_ago), 1, None)


def test_each_trigger_fires_on_its_own() -> None:
    assert not decide_tick(POLICY, situation()).train
    assert decide_tick(POLICY, situation(new=100)).reason.startswith("100 new consented traces")
    assert "25.0 h old" in decide_tick(POLICY, situation(age_h=25)).reason
    assert "live τ 1.900 is below 2.0" in decide_tick(POLICY, situation(live=1.9)).reason


def test_cooldown_holds_every_trigger_back() -> None:
    held = decide_tick(POLICY, situation(new=500, live=1.0, moved_min_ago=10))
    assert not held.train and held.reason.startswith("cooling down until 2026-12-01 12:20:00")
    assert decide_tick(POLICY, situation(new=500, moved_min_ago=31)).train


def test_no_champion_after_a_first_drafter_was_registered_fires_only_on_traces() -> None:
    s = Situation(NOW, 5, None, None, None, 1, NOW - timedelta(days=1))  # v1 was refused: traffic decides now
    assert not decide_tick(POLICY, s).train
    assert decide_tick(POLICY, Situation(NOW, 100, None, None, None, 1, None)).train


def test_a_base_model_without_any_drafter_trains_its_first_at_once_and_retries_after_the_cooldown() -> None:
    never = Situation(NOW, 0, None, None, None, 0, None)
    assert decide_tick(POLICY, never).reason == "no drafter registered for this base model: training its first"
    assert first_drafter_due(POLICY, never)
    tried = Situation(NOW, 0, None, None, None, 0, NOW - timedelta(minutes=10))  # skipped or failed 10 min ago
    assert not decide_tick(POLICY, tried).train and not first_drafter_due(POLICY, tried)
    assert first_drafter_due(POLICY, Situation(NOW, 0, None, None, None, 0, NOW - timedelta(minutes=31)))
    off = parse_policy("schedule: {interval_minutes: 5}\ntriggers: {first_drafter: false}")
    assert not first_drafter_due(off, never) and not decide_tick(off, never).train
    assert not first_drafter_due(POLICY, situation())  # a champion serves


def test_a_negative_margin_accepts_a_slower_challenger_and_its_noise() -> None:
    assert gate(-0.08, -0.1, required=-1.0).verdict is GateVerdict.PROMOTE
    assert gate(-0.08, -0.1, required=-0.05).verdict is GateVerdict.REFUSE


def contest(suffix_s: float, champion_s: float | None, challenger_s: float = 1.0, margin: float = 0.0):
    """A contest whose contenders replayed 4 traces of equal tokens in the given seconds per trace."""
    from specloop.daemon.evaluation.replay import ReplayStats
    from specloop.daemon.retrain.contest import CHALLENGER, CHAMPION, SUFFIX, Contest

    def stats(seconds: float) -> ReplayStats:
        return ReplayStats(4, 4, 40, 80, (30, 10, 0), (20,) * 4, (10,) * 4, (seconds,) * 4)

    secs = {SUFFIX: suffix_s, CHAMPION: champion_s, CHALLENGER: challenger_s}
    return Contest("sha256:x", 4, 4, {k: stats(v) for k, v in secs.items() if v is not None}, {}, serve_margin=margin)


def test_the_gate_baseline_is_the_faster_of_suffix_decoding_alone_and_the_champion() -> None:
    assert contest(1.0, None).baseline == "suffix"  # no champion: suffix decoding alone serves
    assert contest(1.0, 0.8).baseline == "champion"  # the champion drafts faster than suffix decoding
    slower = contest(1.0, 1.25)
    assert slower.baseline == "suffix" and slower.over_suffix("champion").gain == pytest.approx(-0.2)
    assert slower.speed_gain().gain == 0.0  # the challenger (1 s per trace) against suffix decoding alone
    # 1% faster than suffix decoding alone is not enough where the policy asks 2% of a drafter.
    barely = contest(1.0, 1 / 1.01, margin=0.02)
    assert barely.benched("champion") and barely.baseline == "suffix" and barely.benched("challenger")  # +0%
    assert contest(1.0, 1 / 1.03, margin=0.02).baseline == "champion"

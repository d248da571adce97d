"""The rollout verdict after a promotion: keep watching, passed, roll back, or passed with nothing
to compare against, decided from live τ alone.

Baseline: the previous champion's live τ over the `watch_minutes` before the promotion. New: the
new champion's live τ since the promotion. The new champion is judged once it has run
`min_verify_steps` verify steps, against a baseline of at least as many: a τ from a handful of
steps is noise, on either side of the comparison. A fall below `rollback_below` x the baseline
rolls back at once, even before the window ends; a pass needs the window over too, so a drafter
that holds up only briefly is still caught. Without a baseline (the previous version ran no verify
steps in the window before the promotion, or too few) nothing is compared and the rollout passes
when the window ends and the new champion has its steps. While it has fewer steps it stays
watched, however long that takes: passing a drafter that nobody has used says nothing about it.

It reads samples and changes nothing, and takes `now` from the caller rather than a clock. Not
here: moving the alias (`promotion.py`), the counters (`live_tau.py`).
"""

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from specloop.daemon.retrain.live_tau import LiveTau, TauWindow


class RolloutSettings(Protocol):
    """The policy's `rollout` section, or anything with these three attributes."""

    @property
    def watch_minutes(self) -> float: ...

    @property
    def min_verify_steps(self) -> int: ...

    @property
    def rollback_below(self) -> float: ...  # roll back when new τ < rollback_below x baseline τ


@dataclass(frozen=True)
class Promotion:
    version: str  # the new champion
    previous: str  # the champion it replaced ("none": n-gram lookup alone)
    promoted_at: datetime  # timezone-aware

    def __post_init__(self) -> None:
        if self.promoted_at.tzinfo is None:
            raise ValueError(f"promoted_at must be timezone-aware (UTC), got naive {self.promoted_at}")
        if self.version == self.previous:
            raise ValueError(f"promotion of {self.version} replaces itself")


class RolloutVerdict(StrEnum):
    WATCH = "watch"  # not decided yet; the only verdict that is not final
    PASSED = "passed"  # window over, τ held against the baseline
    ROLL_BACK = "roll_back"  # move the alias back to `Promotion.previous`
    NO_BASELINE = "no_baseline"  # window over, nothing to compare against: passed without a comparison


@dataclass(frozen=True)
class RolloutDecision:
    verdict: RolloutVerdict
    reason: str  # for the log and the promotion history; names τ and step counts where known
    new: TauWindow | None
    baseline: TauWindow | None

    @property
    def final(self) -> bool:
        return self.verdict is not RolloutVerdict.WATCH


def judge_rollout(promotion: Promotion, rollout: RolloutSettings, live: LiveTau, now: datetime) -> RolloutDecision:
    """The verdict on `promotion` at `now`, from the samples `live` holds up to `now`."""
    if now < promotion.promoted_at:
        raise ValueError(f"now {now} is before the promotion at {promotion.promoted_at}")
    watch = timedelta(minutes=rollout.watch_minutes)
    before = live.tau(promotion.previous, promotion.promoted_at - watch, promotion.promoted_at)
    new = live.tau(promotion.version, promotion.promoted_at, now)
    window_over = now >= promotion.promoted_at + watch
    verdict, reason = _decide(promotion, rollout, before, new, window_over)
    return RolloutDecision(verdict, reason, new, _usable(before, rollout))


def _decide(p: Promotion, rollout: RolloutSettings, before: TauWindow | None, new: TauWindow | None,
            window_over: bool) -> tuple[RolloutVerdict, str]:
    need = rollout.min_verify_steps
    steps = new.drafts if new else 0
    base = _base(p, rollout, before)
    if steps < need:
        return RolloutVerdict.WATCH, f"{p.version} has {steps} of {need} verify steps; {base}"
    assert new is not None
    baseline = _usable(before, rollout)
    if baseline is None:
        if not window_over:
            return RolloutVerdict.WATCH, f"{_new(p, new)}; {base}; passes when the window ends"
        return RolloutVerdict.NO_BASELINE, f"passed without a comparison: {_new(p, new)}; {base}"
    floor = rollout.rollback_below * baseline.tau
    compared = f"{_new(p, new)} vs {base} (floor {rollout.rollback_below:g} x that = {floor:.3f})"
    if new.tau < floor:
        return RolloutVerdict.ROLL_BACK, f"roll back: {compared}"
    if not window_over:
        return RolloutVerdict.WATCH, f"holding so far: {compared}"
    return RolloutVerdict.PASSED, f"passed: {compared}"


def _usable(before: TauWindow | None, rollout: RolloutSettings) -> TauWindow | None:
    return before if before is not None and before.drafts >= rollout.min_verify_steps else None


def _new(p: Promotion, new: TauWindow) -> str:
    return f"{p.version} τ {new.tau:.3f} over {new.drafts} verify steps since the promotion"


def _base(p: Promotion, rollout: RolloutSettings, before: TauWindow | None) -> str:
    window = f"the {rollout.watch_minutes:g} min before the promotion"
    if _usable(before, rollout) is None:
        steps = before.drafts if before else 0
        return f"no baseline: {p.previous} ran {steps} of {rollout.min_verify_steps} verify steps in {window}"
    assert before is not None
    return f"{p.previous} τ {before.tau:.3f} over {before.drafts} verify steps in {window}"

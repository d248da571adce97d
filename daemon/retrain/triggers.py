"""Whether a scheduled tick trains: the policy's triggers and cooldown against what the daemon knows.

A pure decision on a `Situation` the caller gathers (new consented traces, the champion's age and
live τ, the last promotion or rollback), so each rule is tested on its own. Any trigger fires a
run; the cooldown after a promotion or rollback holds every trigger back, so a new champion is
watched before it is replaced.

Not here: gathering the numbers (`run.py`), the dataset's own minimum size (checked once it is built).
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from specloop.daemon.retrain.policy import RetrainPolicy


@dataclass(frozen=True)
class Situation:
    now: datetime
    new_traces: int  # consented traces since the data of the last run that trained
    champion_since: datetime | None  # when the champion became champion (None: no champion)
    champion_live_tau: float | None  # over the last rollout.watch_minutes (None: not measured)
    last_alias_move: datetime | None  # the last promotion or rollback
    drafters_registered: int  # versions of the base model in the registry
    last_run_ended: datetime | None  # the newest finished run of the base model, whatever its outcome


@dataclass(frozen=True)
class TickDecision:
    train: bool
    reason: str


def decide_tick(policy: RetrainPolicy, s: Situation) -> TickDecision:
    if s.last_alias_move is not None:
        cooldown_ends = s.last_alias_move + timedelta(minutes=policy.cooldown_minutes)
        if s.now < cooldown_ends:
            return TickDecision(False, f"cooling down until {cooldown_ends:%Y-%m-%d %H:%M:%S} UTC after the last "
                                       f"promotion or rollback")
    t = policy.triggers
    if first_drafter_due(policy, s):
        return TickDecision(True, "no drafter registered for this base model: training its first")
    if s.new_traces >= t.min_new_traces:
        return TickDecision(True, f"{s.new_traces} new consented traces (trigger: {t.min_new_traces})")
    if t.max_champion_age_hours is not None and s.champion_since is not None:
        age_h = (s.now - s.champion_since).total_seconds() / 3600
        if age_h > t.max_champion_age_hours:
            return TickDecision(True, f"the champion is {age_h:.1f} h old (trigger: {t.max_champion_age_hours} h)")
    if t.live_tau_below is not None and s.champion_live_tau is not None and s.champion_live_tau < t.live_tau_below:
        return TickDecision(True, f"live τ {s.champion_live_tau:.3f} is below {t.live_tau_below}")
    return TickDecision(False, f"no trigger: {s.new_traces} new consented traces of {t.min_new_traces} needed")


def first_drafter_due(policy: RetrainPolicy, s: Situation) -> bool:
    """No drafter was ever registered for the base model and none is being waited on: the last run
    that tried (skipped, failed or abandoned) ended at least `cooldown_minutes` ago."""
    if not policy.triggers.first_drafter or s.champion_since is not None or s.drafters_registered > 0:
        return False
    return s.last_run_ended is None or s.now >= s.last_run_ended + timedelta(minutes=policy.cooldown_minutes)

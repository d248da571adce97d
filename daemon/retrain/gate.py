"""The gate: does a challenger replace the champion?

A pure decision on numbers measured in one run: the challenger's decode speed against the
champion's, modelled from the same held-out traces replayed with the proposer serving uses, as a
gain with a paired confidence interval (`daemon/evaluation/speed_gain.py`); τ of both beside it; and
the base-model fingerprint the challenger was trained for against the one served. A challenger for
another base model is refused whatever its speed (a drafter is only ever used with the target it was
trained on). One whose speed gain is below the policy's margin is refused, and so is one whose
interval reaches below zero (a gain within noise). One that passes both is promoted, or waits for a
person's approval when the policy asks for one.

Why speed and not τ: a drafter that is accepted more often can still decode slower (a costlier
drafter, or drafts where suffix decoding's were cheaper and as good); speed is what users get.
With no champion yet, serving drafts with suffix decoding alone, so that is what the challenger
must beat.

Not here: measuring (`daemon/retrain/contest.py`), acting on the decision (`run.py`, `promotion.py`).
"""

from dataclasses import dataclass
from enum import StrEnum

from specloop.daemon.evaluation.speed_gain import SpeedGain
from specloop.daemon.retrain.policy import Gate


class GateVerdict(StrEnum):
    PROMOTE = "promote"
    AWAIT_APPROVAL = "await_approval"
    REFUSE = "refuse"


@dataclass(frozen=True)
class GateDecision:
    verdict: GateVerdict
    reason: str

    @property
    def passed(self) -> bool:
        return self.verdict is not GateVerdict.REFUSE


def decide(gate: Gate, *, served_base_model: str, challenger_base_model: str, speed: SpeedGain,
           tau_challenger: float, tau_champion: float, champion_label: str) -> GateDecision:
    """The verdict and a one-line reason naming the numbers it rests on."""
    assert tau_challenger >= 1 and tau_champion >= 1, (tau_challenger, tau_champion)
    if challenger_base_model != served_base_model:
        return GateDecision(GateVerdict.REFUSE, f"base model mismatch: the challenger was trained for "
                                            f"{challenger_base_model}, the served model is {served_base_model}")
    numbers = f"{speed} over {champion_label}; τ {tau_challenger:.3f} vs {tau_champion:.3f}"
    if speed.gain < gate.min_relative_gain:
        return GateDecision(GateVerdict.REFUSE, f"{numbers}: below the {gate.min_relative_gain:.1%} required gain")
    if speed.low < min(0.0, gate.min_relative_gain):
        return GateDecision(GateVerdict.REFUSE, f"{numbers}: within noise (the interval reaches a loss)")
    if gate.require_approval:
        return GateDecision(GateVerdict.AWAIT_APPROVAL, f"{numbers}: passed; the policy requires approval")
    return GateDecision(GateVerdict.PROMOTE, f"{numbers}: passed")

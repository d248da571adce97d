"""The gate: does a challenger replace the champion?

A pure decision on numbers measured in one run: the challenger's τ and the champion's τ, both
replayed on the same held-out traces with the proposer serving uses, and the base-model
fingerprint the challenger was trained for against the one served. A challenger for another base
model is refused whatever its τ (a drafter is only ever used with the target it was trained on).
One that does not beat the champion by the policy's relative margin is refused. One that does is
promoted, or waits for a person's approval when the policy asks for one.

With no champion yet, serving drafts with n-gram lookup alone, so that is what the challenger must
beat (the caller passes its τ as `tau_champion`).

Not here: measuring τ (`daemon/evaluation/replay.py`), acting on the decision (`run.py`, `promotion.py`).
"""

from dataclasses import dataclass
from enum import StrEnum

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


def decide(gate: Gate, *, served_base_model: str, challenger_base_model: str, tau_challenger: float,
           tau_champion: float, eval_sequences: int, champion_label: str) -> GateDecision:
    """The verdict and a one-line reason naming the numbers it rests on."""
    assert tau_challenger >= 1 and tau_champion >= 1, (tau_challenger, tau_champion)
    if challenger_base_model != served_base_model:
        return GateDecision(GateVerdict.REFUSE, f"base model mismatch: the challenger was trained for "
                                            f"{challenger_base_model}, the served model is {served_base_model}")
    gain = tau_challenger / tau_champion - 1
    numbers = (f"τ {tau_challenger:.3f} vs {champion_label} {tau_champion:.3f} ({gain:+.1%}) on "
               f"{eval_sequences} held-out traces")
    if gain < gate.min_relative_gain:
        return GateDecision(GateVerdict.REFUSE, f"{numbers}: below the {gate.min_relative_gain:.1%} required gain")
    if gate.require_approval:
        return GateDecision(GateVerdict.AWAIT_APPROVAL, f"{numbers}: passed; the policy requires approval")
    return GateDecision(GateVerdict.PROMOTE, f"{numbers}: passed")

"""How much faster one contender decodes than another, with a paired bootstrap confidence interval.

Both contenders replayed the same traces, so each trace's tokens are the same for both and only
its seconds differ: the gain is Σ seconds(base) / Σ seconds(new) − 1 over the traces, and the
interval resamples traces (the same resample for both: paired), which keeps what a trace costs
whoever drafts it out of the noise. A gain whose interval reaches below zero is within noise.
Not here: where the seconds come from (`step_cost.py`, `replay.py`), what gain promotes (`daemon/retrain/gate.py`).
"""

from dataclasses import dataclass

import numpy as np

ROUNDS = 2000


@dataclass(frozen=True)
class SpeedGain:
    gain: float  # new's tokens/s over base's, − 1
    low: float  # the confidence interval's bounds on `gain`
    high: float
    confidence: float
    traces: int

    def __str__(self) -> str:
        return (f"{self.gain:+.1%} decode speed ({self.confidence:.0%} CI {self.low:+.1%} to {self.high:+.1%}, "
                f"{self.traces} traces)")

    def to_json(self) -> dict[str, float]:
        return {"speed_gain": self.gain, "speed_gain_low": self.low, "speed_gain_high": self.high}


def paired_speed_gain(base_seconds: tuple[float, ...], new_seconds: tuple[float, ...], confidence: float = 0.95,
                      rounds: int = ROUNDS, seed: int = 0) -> SpeedGain:
    """Per-trace seconds of the same traces under two contenders → the gain of `new` over `base`."""
    base, new = np.asarray(base_seconds), np.asarray(new_seconds)
    assert base.shape == new.shape and base.ndim == 1 and len(base) > 0, (base.shape, new.shape)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    picks = np.random.default_rng(seed).integers(0, len(base), (rounds, len(base)))  # [rounds, n]
    gains = base[picks].sum(axis=1) / new[picks].sum(axis=1) - 1
    tail = (1 - confidence) / 2
    low, high = np.quantile(gains, [tail, 1 - tail])
    return SpeedGain(float(base.sum() / new.sum() - 1), float(low), float(high), confidence, len(base))

"""The paired bootstrap of a speed gain: the point estimate, and an interval that reaches zero only
when the per-trace differences are noise."""

import numpy as np
import pytest

from specloop.daemon.evaluation.speed_gain import paired_speed_gain


def test_a_consistent_gain_has_an_interval_above_zero() -> None:
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 10, 200)  # traces of very different lengths: pairing removes that spread
    gain = paired_speed_gain(tuple(base), tuple(base / 1.1 * rng.uniform(0.97, 1.03, 200)))
    assert gain.gain == pytest.approx(0.1, abs=0.01)
    assert 0.05 < gain.low < gain.gain < gain.high < 0.15 and gain.traces == 200


def test_noise_alone_gives_an_interval_around_zero() -> None:
    rng = np.random.default_rng(1)
    base = rng.uniform(1, 10, 200)
    gain = paired_speed_gain(tuple(base), tuple(base * rng.uniform(0.8, 1.2, 200)))
    assert gain.low < 0 < gain.high


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="confidence"):
        paired_speed_gain((1.0,), (1.0,), confidence=1.0)

"""Correcting a proposer's acceptance estimates by how often they came true in verify passes."""

import pytest
import torch

from specloop.engine.speculation.calibration import AcceptanceCalibration


def test_an_empty_table_returns_the_estimates_non_increasing_and_no_draft_stays_zero() -> None:
    calibration = AcceptanceCalibration(positions=4)
    confidence = torch.tensor([[0.9, 0.95, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(calibration.correct(confidence), torch.tensor([[0.9, 0.9, 0.3, 0.0], [0.0] * 4]))


def test_drafts_estimated_certain_but_accepted_a_third_of_the_time_are_corrected_towards_a_third() -> None:
    calibration = AcceptanceCalibration(positions=2, strength=10)
    for i in range(300):  # one draft at 1.0 per row, verified, accepted every third time
        calibration.record(torch.tensor([[1.0, 0.0]]), verified=[1], accepted=[int(i % 3 == 0)])
    corrected = calibration.correct(torch.tensor([[1.0, 1.0], [0.55, 0.0]]))
    assert corrected[0, 0].item() == pytest.approx((100 + 10) / (300 + 10))
    assert corrected[0, 1].item() == pytest.approx(corrected[0, 0].item())  # position 1 unseen: 1.0, capped by 0
    assert corrected[1, 0].item() == pytest.approx(0.55)  # another estimate's cell: unseen, unchanged


def test_only_verified_drafts_are_counted() -> None:
    calibration = AcceptanceCalibration(positions=3)
    calibration.record(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), verified=[0, 2], accepted=[0, 1])
    assert calibration.verified.sum() == 2 and calibration.verified[2].sum() == 0
    assert calibration.accepted[0].sum() == 1 and calibration.accepted[1].sum() == 0


def test_past_its_window_a_cell_halves_and_keeps_its_rate() -> None:
    calibration = AcceptanceCalibration(positions=1, window=100)
    for i in range(101):
        calibration.record(torch.tensor([[0.75]]), verified=[1], accepted=[int(i % 4 != 0)])
    assert calibration.verified.sum() == pytest.approx(50.5)
    assert calibration.accepted.sum() / calibration.verified.sum() == pytest.approx(75 / 101)


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError, match="positions"):
        AcceptanceCalibration(positions=0)
    with pytest.raises(ValueError, match="strength"):
        AcceptanceCalibration(positions=2, strength=0)

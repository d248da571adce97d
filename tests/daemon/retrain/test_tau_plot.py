"""The live-τ picture: a real PNG of the size asked for, the same bytes for the same inputs, an
empty-state figure with nothing to draw, and a clear error for an unknown event."""

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from specloop.daemon.retrain.live_tau import EngineSample, LiveTau, TauPoint, VersionCounters
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.retrain.tau_plot import plot_live_tau

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Event:
    at: datetime
    action: str
    version: str


EVENTS = [Event(T0 + timedelta(minutes=30), "promoted", "v4"), Event(T0 + timedelta(minutes=50), "rolled_back", "v4")]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def series(tmp_path: Path) -> dict[str, list[TauPoint]]:
    """An hour of one engine: v3 at τ 3 until minute 30, v4 at τ 2 after, from a real LiveTau."""
    live = LiveTau(open_state(f"sqlite:///{tmp_path}/state.db"))
    counters = {"v3": VersionCounters(0, 0)}
    for m in range(61):
        version, tau = ("v3", 3) if m <= 30 else ("v4", 2)
        c = counters.get(version, VersionCounters(0, 0))
        counters[version] = VersionCounters(c.drafts + 10, c.accepted_tokens + 10 * (tau - 1))
        live.record([EngineSample("http://engine-1:8000", T0 + timedelta(minutes=m), version, dict(counters))])
    return live.series(since=T0, bucket_s=300)


def test_the_plot_is_a_png_of_the_set_size(tmp_path: Path, series: dict[str, list[TauPoint]]) -> None:
    assert {p.tau for p in series["v3"]} == {3.0} and {p.tau for p in series["v4"]} == {2.0}
    out = plot_live_tau(series, EVENTS, tmp_path / "report" / "live_tau.png")
    assert out == tmp_path / "report" / "live_tau.png"
    assert out.stat().st_size > 10_000  # a drawn chart, not a blank canvas
    assert png_size(out) == (1000, 500)


def test_the_same_inputs_give_the_same_bytes(tmp_path: Path, series: dict[str, list[TauPoint]]) -> None:
    a = plot_live_tau(series, EVENTS, tmp_path / "a.png").read_bytes()
    b = plot_live_tau(series, list(reversed(EVENTS)), tmp_path / "b.png").read_bytes()
    without_events = plot_live_tau(series, [], tmp_path / "c.png").read_bytes()
    assert a == b
    assert a != without_events


def test_nothing_to_draw_writes_an_empty_state_figure(tmp_path: Path) -> None:
    out = plot_live_tau({}, [], tmp_path / "empty.png")
    assert png_size(out) == (1000, 500)
    events_only = plot_live_tau({"v3": []}, EVENTS[:1], tmp_path / "events.png")
    assert png_size(events_only) == (1000, 500)
    assert out.read_bytes() != events_only.read_bytes()


def test_an_unknown_event_action_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'deleted' is not one of promoted"):
        plot_live_tau({}, [Event(T0, "deleted", "v4")], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()

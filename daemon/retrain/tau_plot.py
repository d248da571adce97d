"""The live-τ picture: τ over time, one line per drafter version, with a vertical marker and label
for each promotion, rollback, refusal, approval request, approval and rejection.

Drawn on a bare matplotlib `Figure` with the Agg canvas, never pyplot, so it keeps no global state
and can run on any thread of the daemon. The same inputs give the same bytes: fixed size and dpi,
and no matplotlib version in the PNG's metadata. With nothing to draw it still writes a figure,
saying there are no samples yet, so a report always has its picture.

Not here: where the numbers come from (`live_tau.py`), when a picture is made.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

import matplotlib.dates as mdates
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specloop.daemon.retrain.live_tau import TauPoint

_EVENT_STYLE = {  # action -> (colour, line style)
    "promoted": ("tab:green", "-"),
    "rolled_back": ("tab:red", "-"),
    "refused": ("tab:gray", ":"),
    "approved": ("tab:blue", "--"),
    "rejected": ("tab:orange", "--"),
    "awaiting_approval": ("tab:purple", ":"),  # history.py records it too
}
_SIZE_IN = (10.0, 5.0)
_DPI = 100


class TauEvent(Protocol):
    """Anything with these attributes: a row of the promotion history, say."""

    @property
    def at(self) -> datetime: ...  # timezone-aware

    @property
    def action(self) -> str: ...  # a key of _EVENT_STYLE

    @property
    def version(self) -> str: ...


def plot_live_tau(series: Mapping[str, Sequence[TauPoint]], events: Iterable[TauEvent], out_png: Path) -> Path:
    """Write the picture of `series` (as `LiveTau.series` returns it) and `events` to `out_png`."""
    events = sorted(events, key=lambda e: (e.at, e.action, e.version))
    for e in events:
        if e.action not in _EVENT_STYLE:
            raise ValueError(f"event action {e.action!r} is not one of {', '.join(_EVENT_STYLE)}")
    fig = Figure(figsize=_SIZE_IN, dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_series(ax, series)
    _draw_events(ax, events)
    ax.set_title("Live τ per drafter version")
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel("τ (tokens committed per verify step)")
    if not any(series.values()) and not events:
        ax.text(0.5, 0.5, "no live τ samples yet", transform=ax.transAxes, ha="center", va="center")
        ax.set_xticks([])
        ax.set_yticks([])
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, format="png", metadata={"Software": None})
    return out_png


def _draw_series(ax: Axes, series: Mapping[str, Sequence[TauPoint]]) -> None:
    drawn = False
    for version in sorted(series):
        if series[version]:
            ax.plot(*_line(series[version]), marker="o", markersize=3, label=version)
            drawn = True
    if drawn:
        ax.legend(title="drafter version", loc="lower left")
        locator = mdates.AutoDateLocator(tz=UTC)  # not rcParams' timezone, which a matplotlibrc may change
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))


def _line(points: Sequence[TauPoint]) -> tuple[list[datetime], list[float]]:
    """Each bucket at its middle, with a NaN wherever buckets are missing, so the line breaks
    instead of drawing τ across a time the version served nothing."""
    xs: list[datetime] = []
    ys: list[float] = []
    for before, p in zip([None, *points], points):
        if before is not None and p.start != before.end:
            xs.append(before.end)
            ys.append(math.nan)
        xs.append(p.start + (p.end - p.start) / 2)
        ys.append(p.tau)
    return xs, ys


def _draw_events(ax: Axes, events: Sequence[TauEvent]) -> None:
    for e in events:
        colour, style = _EVENT_STYLE[e.action]
        ax.axvline(e.at, color=colour, linestyle=style, linewidth=1)
        # x in data, y in axes coordinates: the label hangs from the top whatever the τ range.
        ax.text(e.at, 0.98, f"{e.action} {e.version}", transform=ax.get_xaxis_transform(), rotation=90,
                ha="right", va="top", fontsize=8, color=colour, zorder=3,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})  # legible over lines

"""Live τ: scraping a real HTTP server that exports the engine's real metrics, and the sample store
on a SQLite file (windows, two engines, restarts, reopening)."""

import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import FastAPI, Response

from specloop.daemon.retrain.live_tau import EngineSample, EngineUnreachable, LiveTau, VersionCounters, scrape
from specloop.daemon.retrain.state_db import open_state
from specloop.engine.runtime.llm_engine import EngineStats
from specloop.engine.runtime.sequence import SpecStats
from specloop.engine.server.metrics import CONTENT_TYPE, ServerMetrics
from tests.server_thread import serve_in_thread

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
E1, E2 = "http://engine-1:8000", "http://engine-2:8000"


def minutes(n: float) -> datetime:
    return T0 + timedelta(minutes=n)


def sample(url: str, at_min: float, serving: str, **counters: tuple[int, int]) -> EngineSample:
    return EngineSample(url, minutes(at_min), serving, {v: VersionCounters(*c) for v, c in counters.items()})


@pytest.fixture
def live(tmp_path: Path) -> LiveTau:
    return LiveTau(open_state(f"sqlite:///{tmp_path}/state.db"))


def spec(*steps: tuple[int, int]) -> SpecStats:
    """SpecStats of verify steps given as (drafts proposed, drafts accepted)."""
    s = SpecStats()
    for drafted, accepted in steps:
        s.record(drafted, accepted)
    return s


def metrics_app(metrics: ServerMetrics) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    def _metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def test_scrape_reads_the_counters_the_server_exports_per_version() -> None:
    metrics = ServerMetrics(lambda: EngineStats(drafter_version="v4"))
    metrics.record_finished("chat", 0.5, 10, 20, spec((4, 3), (4, 0), (4, 4)), drafter_version="v3")
    metrics.record_finished("chat", 0.5, 10, 20, spec((4, 1)), drafter_version="v3")
    metrics.record_finished("completions", 0.2, 5, 6, spec((2, 2), (2, 1)), drafter_version=None)
    metrics.record_finished("chat", 0.1, 5, 6, SpecStats(), drafter_version="v4")  # drafted nothing
    with serve_in_thread(metrics_app(metrics)) as url:
        got = scrape(url, timeout_s=5)
    assert got.url == url and got.serving == "v4"
    assert got.counters == {"v3": VersionCounters(drafts=4, accepted_tokens=8),
                            "none": VersionCounters(drafts=2, accepted_tokens=3)}
    assert abs(got.at - datetime.now(UTC)) < timedelta(seconds=30)


def test_scrape_reads_the_versions_that_failed_their_canary() -> None:
    metrics = ServerMetrics(lambda: EngineStats(drafter_version="v4"))
    metrics.record_canary("v4", 1.43, passed=True)
    metrics.record_canary("v5", 1.1, passed=False)
    with serve_in_thread(metrics_app(metrics)) as url:
        assert scrape(url, timeout_s=5).canary_failed == {"v5": pytest.approx(1.1)}


def test_scrape_of_a_closed_port_raises_engine_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineUnreachable, match=str(port)):
        scrape(f"http://127.0.0.1:{port}", timeout_s=2)


def test_scrape_of_a_server_without_metrics_raises_engine_unreachable() -> None:
    with serve_in_thread(FastAPI()) as url, pytest.raises(EngineUnreachable, match="404"):
        scrape(url, timeout_s=5)


def test_scrape_of_metrics_that_are_not_a_specloop_engines_raises() -> None:
    app = FastAPI()
    app.get("/metrics")(lambda: Response("other_total 3\n", media_type="text/plain"))
    with serve_in_thread(app) as url, pytest.raises(EngineUnreachable, match="not a specloop engine"):
        scrape(url, timeout_s=5)


def test_tau_is_the_gain_over_the_window_summed_over_engines(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v3", v3=(100, 150)), sample(E2, 0, "v3", v3=(1000, 9000))])
    live.record([sample(E1, 10, "v3", v3=(150, 250)), sample(E2, 10, "v3", v3=(1030, 9040))])
    live.record([sample(E1, 20, "v3", v3=(170, 300))])
    w = live.tau("v3", since=minutes(0), until=minutes(10))
    assert (w.drafts, w.accepted, w.engines) == (50 + 30, 100 + 40, 2)
    assert w.tau == pytest.approx(1 + 140 / 80)
    w = live.tau("v3", since=minutes(10), until=minutes(30))
    assert (w.drafts, w.accepted, w.engines) == (20, 50, 1)


def test_the_window_starts_from_each_engines_last_scrape_before_it(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v3", v3=(100, 100))])
    live.record([sample(E1, 5, "v3", v3=(110, 130))])
    live.record([sample(E1, 15, "v3", v3=(140, 200))])
    # (7, 15]: from the scrape at 5, the last before 7, to the one at 15.
    assert live.tau("v3", since=minutes(7), until=minutes(15)).drafts == 30
    # (0, 14]: the scrape at 15 is outside, so only the gain credited at 5.
    assert live.tau("v3", since=minutes(0), until=minutes(14)).drafts == 10


def test_an_engine_first_scraped_inside_the_window_counts_only_what_it_gained_after(live: LiveTau) -> None:
    live.record([sample(E1, 5, "v3", v3=(500, 900))])
    live.record([sample(E1, 6, "v3", v3=(510, 940))])
    w = live.tau("v3", since=minutes(0), until=minutes(10))
    assert (w.drafts, w.accepted) == (10, 40)


def test_a_counter_that_falls_means_a_restart_and_counts_from_zero(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v3", v3=(100, 200))])
    live.record([sample(E1, 1, "v3", v3=(150, 300))])
    live.record([sample(E1, 2, "v3", v3=(20, 30))])  # restarted, then 20 verify steps
    live.record([sample(E1, 3, "v3", v3=(25, 40))])
    w = live.tau("v3", since=minutes(0), until=minutes(3))
    assert (w.drafts, w.accepted) == (50 + 20 + 5, 100 + 30 + 10)


def test_a_restart_seen_in_another_version_resets_every_counter(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v3", v3=(100, 200), none=(40, 40))])
    # v3 grew past its old value after the restart; only the fall of "none" gives the restart away.
    live.record([sample(E1, 1, "v3", v3=(130, 260), none=(3, 3))])
    assert live.tau("v3", since=minutes(0), until=minutes(1)).drafts == 130


def test_a_version_that_vanished_from_the_counters_means_a_restart(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v4", v3=(100, 200), v4=(10, 20))])
    live.record([sample(E1, 1, "v4", v4=(12, 24))])  # a live process never drops a labelled counter
    assert live.tau("v4", since=minutes(0), until=minutes(1)).drafts == 12


def test_no_verify_steps_in_the_window_gives_none(live: LiveTau) -> None:
    live.record([sample(E1, 0, "v3", v3=(100, 200))])
    live.record([sample(E1, 1, "v3", v3=(100, 200))])
    assert live.tau("v3", since=minutes(0), until=minutes(1)) is None
    assert live.tau("v9", since=minutes(0), until=minutes(1)) is None
    assert live.tau("v3", since=minutes(5), until=minutes(6)) is None


def test_samples_survive_reopening_the_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/state.db"
    db = open_state(url)
    LiveTau(db).record([sample(E1, 0, "v3", v3=(0, 0)), sample(E1, 1, "v3", v3=(10, 25))])
    db.dispose()
    w = LiveTau(open_state(url)).tau("v3", since=minutes(0), until=minutes(1))
    assert (w.drafts, w.accepted, w.engines) == (10, 25, 1)


def test_series_gives_tau_per_version_per_bucket(live: LiveTau) -> None:
    counters = [(0, 0, 0, 0), (10, 10, 0, 0), (20, 20, 0, 0), (20, 20, 10, 30), (20, 20, 30, 90)]
    for i, (d3, a3, d4, a4) in enumerate(counters):
        live.record([sample(E1, i, "v4" if i >= 3 else "v3", v3=(d3, a3), v4=(d4, a4))])
    got = live.series(since=minutes(0), bucket_s=120)
    assert list(got) == ["v3", "v4"]
    assert [(p.start, p.end, p.tau, p.drafts) for p in got["v3"]] == [
        (minutes(0), minutes(2), 2.0, 10), (minutes(2), minutes(4), 2.0, 10)]
    assert [(p.start, p.tau, p.drafts) for p in got["v4"]] == [(minutes(2), 4.0, 10), (minutes(4), 4.0, 20)]
    assert list(live.series(since=minutes(0), bucket_s=60, until=minutes(2))) == ["v3"]


def test_bad_arguments_are_value_errors(live: LiveTau) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        EngineSample(E1, datetime(2025, 3, 1), "v3")
    with pytest.raises(ValueError, match="timezone-aware"):
        live.tau("v3", since=datetime(2025, 3, 1), until=minutes(1))
    with pytest.raises(ValueError, match="before since"):
        live.tau("v3", since=minutes(2), until=minutes(1))
    with pytest.raises(ValueError, match="bucket_s"):
        live.series(since=minutes(0), bucket_s=0)

"""Live τ per drafter version: the engines' speculation counters, scraped from `/metrics` and kept
in the daemon's state database, and τ over any time window computed from them.

τ has the meaning of docs/architecture.md, "Acceptance numbers": tokens committed per verify step,
the bonus token included, `1 + accepted_tokens / drafts`, pooled by summing the counters of every
engine before dividing. The counters are cumulative per engine process, so a window's counts are
the gains between consecutive scrapes of one engine, credited at the later scrape's time. An engine
that restarts starts again from zero; any counter of it that fell or vanished between two scrapes
says so, and then each counter's gain is its new value. (A restart goes unseen only when every
counter re-grew past its old value within one scrape interval, which takes an engine that had been
up for less than that interval.)

Not here: when to scrape (the daemon's scheduler), what a fall in τ means (`rollback.py`), the
picture (`tau_plot.py`), the database connection (`state_db.py`).
"""

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    delete,
    func,
    insert,
    or_,
    select,
)

from specloop.daemon.retrain.state_db import create_tables

# Sample names as engine/server/metrics.py exports them (prometheus-client adds `_total`).
_DRAFTS = "specloop_spec_decode_num_drafts_total"
_ACCEPTED = "specloop_spec_decode_num_accepted_tokens_total"
_SERVING = "specloop_drafter_serving"
_CANARY = "specloop_drafter_canary_tau"

_metadata = MetaData()
_samples = Table(
    "live_tau_samples", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),  # scrape time, Unix seconds (UTC)
    Column("engine", String, nullable=False),  # the engine's base URL
    Column("drafter_version", String, nullable=False),  # "none": n-gram lookup alone
    # Cumulative since the engine process started; BigInteger because a busy engine passes 2^31
    # draft tokens within weeks and Postgres' Integer is 32-bit.
    Column("drafts", BigInteger, nullable=False),
    Column("accepted_tokens", BigInteger, nullable=False),
    Column("serving", Boolean, nullable=False),  # the version new requests got at scrape time
    Index("ix_live_tau_samples_engine_at", "engine", "at"),
    Index("ix_live_tau_samples_at", "at"),
)


class EngineUnreachable(RuntimeError):
    """No sample from an engine: connection error, timeout, a status other than 200, or a /metrics
    that is not a specloop engine's. The caller logs it and scrapes the others."""


@dataclass(frozen=True)
class VersionCounters:
    """One drafter version's cumulative counters in one engine process."""

    drafts: int  # verify steps that carried drafts
    accepted_tokens: int  # drafts accepted, bonus token excluded

    def __post_init__(self) -> None:
        assert self.drafts >= 0 and self.accepted_tokens >= 0


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine. A version missing from `counters` has drafted nothing there yet."""

    url: str
    at: datetime  # timezone-aware
    serving: str  # the version new requests get ("none": n-gram lookup alone)
    counters: Mapping[str, VersionCounters] = field(default_factory=dict)
    canary_failed: Mapping[str, float] = field(default_factory=dict)  # version -> its live τ on the probes

    def __post_init__(self) -> None:
        _require_aware("at", self.at)


@dataclass(frozen=True)
class TauWindow:
    """One version's counter gains over a window, summed over engines; only built when drafts > 0."""

    drafts: int
    accepted: int
    engines: int  # engines that ran verify steps for the version in the window

    def __post_init__(self) -> None:
        assert self.drafts > 0 and self.accepted >= 0 and self.engines > 0

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts


@dataclass(frozen=True)
class TauPoint:
    """τ of one version in one time bucket [start, end)."""

    start: datetime
    end: datetime
    tau: float
    drafts: int


@dataclass(frozen=True)
class _Gain:
    at: float  # Unix seconds of the later of the two scrapes
    engine: str
    version: str
    drafts: int
    accepted: int


def scrape(url: str, timeout_s: float) -> EngineSample:
    """The speculation counters and serving version of the engine at base URL `url`."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise EngineUnreachable(f"{url}: {e!r}") from e
    if response.status_code != 200:
        raise EngineUnreachable(f"{url}/metrics answered {response.status_code}")
    return _parse(url, datetime.now(UTC), response.text)


def _parse(url: str, at: datetime, text: str) -> EngineSample:
    drafts: dict[str, int] = {}
    accepted: dict[str, int] = {}
    serving: list[str] = []
    canary_failed: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                version = s.labels.get("drafter_version")
                if s.name == _DRAFTS:
                    drafts[version] = int(s.value)
                elif s.name == _ACCEPTED:
                    accepted[version] = int(s.value)
                elif s.name == _SERVING and s.value == 1:
                    serving.append(version)
                elif s.name == _CANARY and s.labels.get("result") == "fail":
                    canary_failed[version] = s.value
    except ValueError as e:
        raise EngineUnreachable(f"{url}/metrics is not Prometheus text: {e}") from e
    if len(serving) != 1:
        raise EngineUnreachable(f"{url}/metrics has {len(serving)} {_SERVING} series, not 1: not a specloop engine")
    counters = {v: VersionCounters(d, accepted.get(v, 0)) for v, d in drafts.items()}
    return EngineSample(url=url, at=at, serving=serving[0], counters=counters, canary_failed=canary_failed)


class LiveTau:
    """Samples in the `live_tau_samples` table of the state database, and τ computed from them.

    Safe to share between threads: every call takes its own connection from the SQLAlchemy pool."""

    def __init__(self, db: Engine) -> None:
        create_tables(_metadata, db)
        self.db = db

    def record(self, samples: Iterable[EngineSample]) -> None:
        rows = [row for s in samples for row in _rows(s)]
        if rows:
            with self.db.begin() as conn:
                conn.execute(insert(_samples), rows)

    def expire(self, before: datetime) -> int:
        """Delete the samples scraped before `before`; how many. Windows that start later keep their
        baseline (each engine's last scrape at or before the window's start)."""
        _require_aware("before", before)
        with self.db.begin() as conn:
            return conn.execute(delete(_samples).where(_samples.c.at < before.timestamp())).rowcount

    def tau(self, version: str, since: datetime, until: datetime) -> TauWindow | None:
        """`version`'s τ over (since, until], or None when it ran no verify step there."""
        drafts, accepted, engines = 0, 0, set()
        for g in self._gains(since, until):
            if g.version == version and g.drafts:
                drafts, accepted = drafts + g.drafts, accepted + g.accepted
                engines.add(g.engine)
        return TauWindow(drafts, accepted, len(engines)) if drafts else None

    def series(self, since: datetime, bucket_s: float, until: datetime | None = None) -> dict[str, list[TauPoint]]:
        """τ per version per `bucket_s` bucket from `since` (to `until`, or the last sample), by
        version then time; buckets where a version ran no verify step are left out."""
        if bucket_s <= 0:
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        start = since.timestamp()
        sums: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for g in self._gains(since, until):
            if g.drafts:
                bucket = sums[g.version][math.floor((g.at - start) / bucket_s)]
                bucket[0] += g.drafts
                bucket[1] += g.accepted
        return {v: [_point(start, bucket_s, i, d, a) for i, (d, a) in sorted(sums[v].items())] for v in sorted(sums)}

    def _gains(self, since: datetime, until: datetime | None) -> list[_Gain]:
        """Counter gains credited in (since, until]. Each engine's last scrape at or before `since` is
        the baseline; an engine first scraped later has its first scrape in the window as baseline
        instead, so what it counted before that scrape is left out rather than guessed."""
        _require_aware("since", since)
        lo, hi = since.timestamp(), math.inf if until is None else _require_aware("until", until).timestamp()
        if hi < lo:
            raise ValueError(f"until {until} is before since {since}")
        t = _samples.c
        baseline = select(t.engine, func.max(t.at).label("at")).where(t.at <= lo).group_by(t.engine).subquery()
        query = (select(t.at, t.engine, t.drafter_version, t.drafts, t.accepted_tokens)
                 .select_from(_samples.outerjoin(baseline, t.engine == baseline.c.engine))
                 .where(t.at <= hi, or_(t.at >= baseline.c.at, t.at > lo)))
        with self.db.connect() as conn:
            rows = conn.execute(query).all()
        scrapes: dict[str, dict[float, dict[str, tuple[int, int]]]] = defaultdict(lambda: defaultdict(dict))
        for at, engine, version, drafts, accepted in rows:
            scrapes[engine][at][version] = (drafts, accepted)
        return [g for engine, by_time in scrapes.items() for g in _engine_gains(engine, by_time)]


def _engine_gains(engine: str, by_time: Mapping[float, Mapping[str, tuple[int, int]]]) -> list[_Gain]:
    """Gains between consecutive scrapes of one engine; a counter that fell or vanished means the
    process restarted, and then every counter's gain is its new value."""
    times = sorted(by_time)
    gains = []
    for before, after in itertools.pairwise(times):
        prev, cur = by_time[before], by_time[after]
        restarted = any(cur.get(v, (0, 0))[i] < counts[i] for v, counts in prev.items() for i in (0, 1))
        for version, (drafts, accepted) in cur.items():
            d0, a0 = (0, 0) if restarted else prev.get(version, (0, 0))
            gains.append(_Gain(after, engine, version, drafts - d0, accepted - a0))
    return gains


def _rows(s: EngineSample) -> list[dict]:
    # The serving version gets a row even before it drafts, so the table says what each engine served.
    counters = {s.serving: VersionCounters(0, 0), **s.counters}
    return [{"at": s.at.timestamp(), "engine": s.url, "drafter_version": v, "drafts": c.drafts,
             "accepted_tokens": c.accepted_tokens, "serving": v == s.serving} for v, c in counters.items()]


def _point(start: float, bucket_s: float, index: int, drafts: int, accepted: int) -> TauPoint:
    lo = start + index * bucket_s
    return TauPoint(start=datetime.fromtimestamp(lo, UTC), end=datetime.fromtimestamp(lo + bucket_s, UTC),
                    tau=1.0 + accepted / drafts, drafts=drafts)


def _require_aware(name: str, at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (UTC), got naive {at}")
    return at

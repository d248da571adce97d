"""The daemon's watch, every few seconds: read live τ from the engines, act on approvals, and judge
the newest promotion, rolling it back when its live τ fell, or at once when an engine says it failed
its canary (it drafted the probes far worse serving than when it was registered; the engine has
already swapped it out: engine/speculation/canary.py).

An unreachable engine is logged and skipped (the others still count; a down engine serves nothing
to judge). A promotion is watched until its rollout verdict is final; the verdict is recorded in
the history only when it is a rollback (a pass needs no action, and `specloop status` shows it).

Not here: the verdict (`rollback.py`), alias moves (`promotion.py`), the counters (`live_tau.py`).
"""

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from specloop.daemon.retrain import promotion
from specloop.daemon.retrain.history import Action, Event, PromotionHistory
from specloop.daemon.retrain.live_tau import EngineUnreachable, LiveTau, scrape
from specloop.daemon.retrain.policy import Rollout
from specloop.daemon.retrain.rollback import Promotion, RolloutDecision, RolloutVerdict, judge_rollout
from specloop.daemon.retrain.tau_plot import plot_live_tau
from specloop.storage.registry import DrafterRegistry

log = logging.getLogger(__name__)

_SCRAPE_TIMEOUT_S = 5.0
_PLOT_EVERY_S = 60.0
_PLOT_SPAN = timedelta(hours=6)
_PLOT_BUCKET_S = 30.0  # one point per 30 s: a few verify steps per second per engine on 2 cores


@dataclass
class Watch:
    base_model: str
    registry: DrafterRegistry
    history: PromotionHistory
    live: LiveTau
    rollout: Rollout
    engines: list[str]
    plot: Path | None = None  # redrawn at most every _PLOT_EVERY_S
    last_verdict: RolloutDecision | None = None
    plotted_at: float = 0.0
    judged: Event | None = None  # the newest promotion whose verdict is final
    unreachable: set[str] = field(default_factory=set)
    canary_failed: dict[str, str] = field(default_factory=dict)  # version -> which engine, and its τ there

    def __call__(self, now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        self.scrape_engines()
        promotion.settle_approval(self.registry, self.history, self.base_model)
        self.judge(now)
        if self.plot is not None and time.monotonic() - self.plotted_at >= _PLOT_EVERY_S:
            self.draw(now)

    def draw(self, now: datetime) -> Path:
        """The PNG of live τ since the first sample of the last `_PLOT_SPAN`, events marked."""
        assert self.plot is not None
        since = now - _PLOT_SPAN
        events = [e for e in self.history.events(self.base_model) if e.at >= since]
        self.plotted_at = time.monotonic()
        return plot_live_tau(self.live.series(since, _PLOT_BUCKET_S, now), events, self.plot)

    def scrape_engines(self) -> None:
        samples = []
        for url in self.engines:
            try:
                samples.append(scrape(url, _SCRAPE_TIMEOUT_S))
            except EngineUnreachable as e:
                if url not in self.unreachable:  # one line when it goes away, one when it is back
                    log.warning("engine %s: %s; its live τ is not counted until it answers", url, e)
                self.unreachable.add(url)
                continue
            if url in self.unreachable:
                log.info("engine %s answers again", url)
                self.unreachable.discard(url)
            for version, tau in samples[-1].canary_failed.items():
                self.canary_failed.setdefault(version, f"engine {url}: live τ {tau:.3f} on the canary probes")
        self.live.record(samples)

    def judge(self, now: datetime) -> RolloutDecision | None:
        """The verdict on the newest promotion, while it is the newest alias move, has a champion to
        return to and has no final verdict yet (None otherwise)."""
        event = self.history.last(self.base_model, Action.PROMOTED, Action.ROLLED_BACK)
        if event is None or event.action is not Action.PROMOTED or event.previous is None or event == self.judged:
            return None
        if event.at > now:  # another daemon of a fleet promoted since `now` was read: judged next time
            return None
        if event.version in self.canary_failed:
            reason = f"canary failed on {self.canary_failed[event.version]}"
            promotion.roll_back(self.registry, self.history, self.base_model, event.version.removeprefix("v"),
                                event.previous.removeprefix("v"), reason)
            self.judged = event
            return None
        verdict = judge_rollout(Promotion(event.version, event.previous, event.at), self.rollout, self.live, now)
        if verdict.verdict is RolloutVerdict.ROLL_BACK:
            promotion.roll_back(self.registry, self.history, self.base_model, event.version.removeprefix("v"),
                                event.previous.removeprefix("v"), verdict.reason)
        if verdict.final:
            self.judged = event
            log.info("rollout of %s: %s", event.version, verdict.reason)
        self.last_verdict = verdict
        return verdict

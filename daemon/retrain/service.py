"""`RetrainDaemon`: the long-running retraining service for one base model.

It loads the target once, then runs two jobs on an APScheduler 3.x `BackgroundScheduler`:

- the tick, on the policy's schedule (cron or interval), persisted in the state database's job
  store so a tick missed while the daemon was down still runs on restart when it is at most the
  policy's misfire grace late; missed ticks coalesce into one, and one executor thread with
  `max_instances=1` means one run at a time. A tick checks the triggers (`triggers.py`) and, when
  one fires, runs under the base model's lease (`lease.py`): two daemons never train for the same
  base model at once, on one machine or many sharing a state database;
- the watch, every `watch_s` seconds (in memory: it has nothing to catch up on): live τ from the
  engines, approvals, rollbacks (`watch.py`), and beside it housekeeping (erasure follow-up,
  retention). Where several daemons share the state database (`specloop fleet`), one of them at a
  time does both, under a second lease (`watch:<base model>`); the others only tick.

Whenever it moves or benches `champion`, it tells the engines to look now (`engine_notice.py`).
At start it finishes what a killed daemon left (`run.resume_promotion`), and when the base model has
no drafter registered at all it brings the first tick forward to now (`triggers.first_drafter_due`).
`shutdown()` (SIGTERM, via
the HTTP server's lifespan) sets the stop event: a run in training stops within a few steps and is
recorded as abandoned, with nothing registered; `shutdown()` waits for it before it stops the
scheduler.

Not here: the HTTP endpoints (`daemon/retrain/http.py`), a run's steps (`run.py`).
"""

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.memory import MemoryJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from specloop.consent.registry import ConsentRegistry
from specloop.consent.settings import ConsentSettings
from specloop.daemon.retrain.engine_notice import EngineNotice
from specloop.daemon.retrain.erasures import ErasureFollowUp
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.job_store import StateJobStore
from specloop.daemon.retrain.lease import Lease, LeaseHeld, daemon_identity
from specloop.daemon.retrain.live_tau import LiveTau
from specloop.daemon.retrain.metrics import DaemonMetrics
from specloop.daemon.retrain.policy import RetrainPolicy, Schedule
from specloop.daemon.retrain.retention import Retention, tenant_retention
from specloop.daemon.retrain.run import Loop, RetrainRun, new_run_id, resume_promotion
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.retrain.state_db import open_state
from specloop.daemon.retrain.status import tick_job_id
from specloop.daemon.retrain.triggers import Situation, TickDecision, decide_tick, first_drafter_due
from specloop.daemon.retrain.watch import Watch
from specloop.engine.loaders.load import LoadedModel
from specloop.storage.dataset import count_consented
from specloop.storage.registry import DrafterRegistry, RegistryUnavailable, Tag

log = logging.getLogger(__name__)

# The persistent job store names the tick's function by import path, so the function finds its
# daemon here by base model.
_DAEMONS: dict[str, "RetrainDaemon"] = {}
RETRY_TICK_S = 60.0


@dataclass(frozen=True)
class TickReport:
    at: datetime
    decision: TickDecision
    run_id: str | None = None


class RetrainDaemon:
    def __init__(self, settings: DaemonSettings, policy: RetrainPolicy, target: LoadedModel,
                 registry: DrafterRegistry | None = None) -> None:
        self.settings, self.policy = settings, policy
        self.db = open_state(settings.state_db)
        self.loop = Loop(policy, settings, registry or DrafterRegistry(settings.registry), target, RunLog(self.db),
                         PromotionHistory(self.db))
        self.live = LiveTau(self.db)
        self.watch = Watch(self.base_model, self.loop.registry, self.loop.history, self.live, policy.rollout,
                           list(settings.engines), settings.plot)
        self.erasures = ErasureFollowUp(self.base_model, settings.traces_root, settings.work_dir, self.loop.registry,
                                        self.loop.history, policy.data.on_erasure, settings.audit_log_path())
        self.retention = Retention(settings.traces_root, settings.work_dir, self.live, settings.audit_log_path(),
                                   tenant_retention(settings.tenants_file), settings.trace_retention_days,
                                   settings.run_retention_days, settings.live_tau_retention_days)
        self.metrics = DaemonMetrics()
        # Engines hear of a moved or benched champion at once rather than at their next poll.
        self.notice = EngineNotice(settings.engines, lambda: ConsentSettings().existing_admin_token(),
                                   self.metrics.engine_notices)
        self.loop.registry.on_serving_change = self.notice
        self.owner = daemon_identity()
        # Daemons of one base model on one state database (a fleet) all tick, and the training lease
        # keeps their runs apart; the watch (live τ, rollbacks, erasure policy) and housekeeping are
        # one daemon's duty at a time too, or two would record every sample and make every rollback.
        self._duty = Lease(self.db, f"watch:{self.base_model}", self.owner,
                           max(settings.lease_ttl_s, _DUTY_INTERVALS * settings.watch_s))
        self._on_duty: bool | None = None
        self._duty_lock = threading.Lock()  # the watch's and housekeeping's threads both ask
        self._mlflow_away: set[str] = set()  # the jobs that found MLflow unavailable at their last run
        self.stop = threading.Event()
        self._ticking = threading.Lock()  # held by a tick, so that shutdown() can wait for it
        self.current_run: str | None = None
        self.last_tick: TickReport | None = None
        self.scheduler = BackgroundScheduler(
            jobstores={"default": StateJobStore(engine=self.db), "memory": MemoryJobStore()},
            executors={"default": ThreadPoolExecutor(1), "watch": ThreadPoolExecutor(1),
                       "housekeeping": ThreadPoolExecutor(1)},
            job_defaults={"coalesce": True, "max_instances": 1}, timezone=UTC)

    @property
    def base_model(self) -> str:
        return self.loop.base_model

    def start(self) -> None:
        _DAEMONS[self.base_model] = self
        self._resume()
        self.scheduler.start(paused=True)
        self._schedule_tick()
        self.scheduler.add_job(self._watch, IntervalTrigger(seconds=self.settings.watch_s), id="watch",
                               jobstore="memory", executor="watch", replace_existing=True)
        # Erasure follow-up and retention rewrite trace files under the root's lock, for as long as
        # that takes: on their own thread, so that rollbacks are never late for them.
        self.scheduler.add_job(self._housekeeping, IntervalTrigger(seconds=self.settings.watch_s), id="housekeeping",
                               jobstore="memory", executor="housekeeping", replace_existing=True)
        self._first_tick_now()
        self.scheduler.resume()
        log.info("retraining daemon for %s started; next tick %s", self.base_model, self.next_tick())

    def _first_tick_now(self) -> None:
        """A base model with no drafter at all gets its first one from the daemon's first start, not at
        the schedule's next tick (hours away in production)."""
        if not self.policy.triggers.first_drafter:
            return
        try:
            due = first_drafter_due(self.policy, self._registry_situation(datetime.now(UTC)))  # no trace scan
        except Exception as e:  # MLflow down, an unreadable trace file: the daemon starts all the same
            log.warning("no early first tick (%s: %s); the schedule's ticks look again", type(e).__name__, e)
            return
        if due:
            log.info("no drafter registered for %s: its first tick runs now to train one", self.base_model)
            self.scheduler.modify_job(tick_job_id(self.base_model), next_run_time=datetime.now(UTC))

    def shutdown(self) -> None:
        """Stop: a run in progress is abandoned at its next check, and waited for; the watch is
        handed over to another daemon at its next interval."""
        self.stop.set()
        # Wait for the tick here, not in the scheduler: APScheduler 3's shutdown(wait=True) holds the
        # job-store lock while it waits for running jobs, and a tick ends by reading its next run
        # time from the job store. Waiting there deadlocked; `make run` killed the daemon after 90 s.
        with self._ticking:
            pass
        if self.scheduler.running:
            self.scheduler.shutdown(wait=True)
        if self._on_duty:  # after the scheduler, so that no watch takes it again
            _survive("watch hand-over", self._duty.release)
        self.notice.close()
        _DAEMONS.pop(self.base_model, None)

    def next_tick(self) -> datetime | None:
        job = self.scheduler.get_job(tick_job_id(self.base_model))
        return None if job is None else job.next_run_time

    def tick(self) -> TickReport:
        """Check the triggers; run when one fires and the lease is ours. After `shutdown()`, nothing."""
        with self._ticking:
            if self.stop.is_set():
                return TickReport(datetime.now(UTC), TickDecision(False, "the daemon is stopping"))
            return self._tick()

    def _tick(self) -> TickReport:
        now = datetime.now(UTC)
        try:
            decision = decide_tick(self.policy, self.situation(now))
        except RegistryUnavailable as e:
            decision = TickDecision(False, f"MLflow unavailable: {e}; looking again in {RETRY_TICK_S:.0f} s")
            self._tick_again_soon()
        report = TickReport(now, decision)
        if decision.train:
            report = TickReport(now, decision, self._run_under_lease(decision.reason))
        else:
            log.info("tick: no run: %s", decision.reason)
        self.metrics.ticks.labels("run" if report.run_id else "skip").inc()
        self.last_tick = report
        self._update_next_tick()
        return report

    def _tick_again_soon(self) -> None:
        """One more tick `RETRY_TICK_S` from now, beside the schedule's (hours away in production): a
        trigger that fired while MLflow was down is not lost for a whole interval."""
        self.scheduler.add_job(scheduled_tick, DateTrigger(datetime.now(UTC) + timedelta(seconds=RETRY_TICK_S)),
                               args=[self.base_model], id=f"{tick_job_id(self.base_model)}-retry", jobstore="memory",
                               replace_existing=True)

    def situation(self, now: datetime) -> Situation:
        return replace(self._registry_situation(now), new_traces=self._new_traces(now))

    def _new_traces(self, now: datetime) -> int:
        """Consented traces of the base model newer than the last trained run's data: a scan of the trace store."""
        last = self.loop.runs.last_trained(self.base_model)
        consent = ConsentRegistry(self.settings.consent_db)
        try:
            snapshot = consent.snapshot(self.policy.data.purpose)
        finally:
            consent.close()
        return count_consented(self.settings.traces_root, snapshot, base_model=self.base_model,
                               since=None if last is None else last.data_until, as_of=now)

    def _registry_situation(self, now: datetime) -> Situation:
        """The situation but the trace count (0 here): all that a first drafter's decision reads."""
        loop = self.loop
        champion = loop.registry.champion(self.base_model)
        promoted = loop.history.last(self.base_model, Action.PROMOTED, Action.ROLLED_BACK)
        champion_since = None
        live_tau = None
        if champion is not None:
            champion_since = (promoted.at if promoted is not None else
                              datetime.fromtimestamp(champion.created_ms / 1000, UTC))
            window = self.live.tau(champion.label, now - timedelta(minutes=self.policy.rollout.watch_minutes), now)
            live_tau = None if window is None else window.tau
        registered, ended = 1, None  # only a base model without a champion may need its first drafter
        if champion is None:
            registered = len(loop.registry.versions(self.base_model))
            ended = max((r.finished_at for r in loop.runs.runs(self.base_model, limit=5) if r.finished_at),
                        default=None)
        return Situation(now, 0, champion_since, live_tau, None if promoted is None else promoted.at,
                         registered, ended)

    def _run_under_lease(self, why: str) -> str | None:
        lease = self._lease()
        run_id = new_run_id()
        try:
            with lease:
                resume_promotion(self.loop)  # what a daemon that died under this lease left
                log.info("tick: run %s: %s", run_id, why)
                self.current_run = run_id
                self.metrics.running.set(1)
                outcome = RetrainRun(self.loop, run_id, self.stop, lambda: "lease lost" if lease.lost else None
                                     ).execute()
        except LeaseHeld as e:
            log.info("tick: no run: %s", e)
            return None
        finally:
            self.current_run = None
            self.metrics.running.set(0)
        self._count(run_id, outcome)
        return run_id

    def _count(self, run_id: str, outcome: RunOutcome) -> None:
        """The finished run's outcome, step times and, when it reached the gate, its numbers."""
        self.metrics.runs.labels(outcome.value).inc()
        record = next((r for r in self.loop.runs.runs(self.base_model, limit=5) if r.run_id == run_id), None)
        for step, seconds in ({} if record is None else record.timings).items():
            self.metrics.step_seconds.labels(step).observe(seconds)
        if record is None or record.version is None:
            return
        version = self.loop.registry.version(self.base_model, record.version)
        self.metrics.gate.labels(version.tags.get(Tag.GATE, "")).inc()
        self.metrics.tau.labels("challenger").set(version.tau_challenger or 0.0)
        self.metrics.tau.labels("champion").set(version.tau_champion or 0.0)
        event = self.loop.history.last(self.base_model)
        if event is not None and event.run_id == run_id:
            self.metrics.alias_moves.labels(event.action.value).inc()

    def _lease(self) -> Lease:
        return Lease(self.db, f"train:{self.base_model}", self.owner, self.settings.lease_ttl_s)

    def _resume(self) -> None:
        lease = self._lease()
        try:
            with lease:
                for run_id in resume_promotion(self.loop):
                    log.info("resumed the promotion step of run %s, killed after it registered", run_id)
        except LeaseHeld as e:  # another daemon is alive, or a dead one's lease has not expired yet
            log.warning("not resuming unfinished runs now (%s); the first run under the lease will", e)
        except RegistryUnavailable as e:
            log.warning("not resuming unfinished runs now (MLflow unavailable: %s); the next start will", e)

    def _watch(self) -> None:
        if not self._has_duty():
            return
        _survive("watch", self.watch, self._mlflow_away)
        # The erasure policy moves aliases: on this thread, as rollbacks do.
        _survive("erasure policy", self.erasures.act, self._mlflow_away)

    def _housekeeping(self) -> None:
        if not self._has_duty():
            return
        _survive("erasure follow-up", self.erasures.apply_journal, self._mlflow_away)
        _survive("retention", lambda: self.retention(self.current_run), self._mlflow_away)

    def _has_duty(self) -> bool:
        """Whether this daemon watches now: it holds, or has just taken, the base model's watch lease
        (another daemon's lapses `_DUTY_INTERVALS` watch intervals after it stops renewing)."""
        with self._duty_lock:  # two threads taking a new lease at once: one's INSERT would fail
            try:
                on = self._duty.try_acquire()
            except Exception as e:  # the state database is away: nothing the watch does could run
                log.warning("watch: the state database is unavailable (%s: %s)", type(e).__name__, e)
                return False
            if on != self._on_duty:
                log.info("watch: %s", "this daemon watches live τ, rollbacks and erasures" if on else
                         "another daemon of this base model watches; this one only ticks")
                self._on_duty = on
            return on

    def _schedule_tick(self) -> None:
        """Keep the stored job (and its next run time, which may be overdue: a misfire) unless the
        schedule changed."""
        trigger = schedule_trigger(self.policy.schedule)
        job = self.scheduler.get_job(tick_job_id(self.base_model))
        if job is not None and str(job.trigger) == str(trigger):
            log.info("tick job found in the job store, due %s", job.next_run_time)
        else:
            self.scheduler.add_job(scheduled_tick, trigger, args=[self.base_model], id=tick_job_id(self.base_model),
                                   replace_existing=True,
                                   misfire_grace_time=int(self.policy.schedule.misfire_grace_minutes * 60))
        self._update_next_tick()

    def _update_next_tick(self) -> None:
        due = self.next_tick()
        if due is not None:
            self.metrics.next_run.set(due.timestamp())


_DUTY_INTERVALS = 4  # the watch lease's TTL in watch intervals (at least the training lease's TTL)


def _survive(what: str, job: Callable[[], object], mlflow_away: set[str] | None = None) -> None:
    """Run `job`; a failure is logged and the next interval tries again. With `mlflow_away` (the jobs
    that found MLflow unavailable last time), its absence is said once when it starts and once when
    it ends, not at every watch interval."""
    try:
        job()
    except RegistryUnavailable as e:
        if mlflow_away is None or what not in mlflow_away:
            log.warning("%s: MLflow unavailable: %s", what, e)
        if mlflow_away is not None:
            mlflow_away.add(what)
        return
    except Exception:
        log.exception("%s failed", what)
    if mlflow_away is not None and what in mlflow_away:
        mlflow_away.discard(what)
        log.info("%s: MLflow answers again", what)


def schedule_trigger(schedule: Schedule) -> BaseTrigger:
    if schedule.cron is not None:
        return CronTrigger.from_crontab(schedule.cron, timezone=UTC)
    return IntervalTrigger(minutes=schedule.interval_minutes, timezone=UTC)


def scheduled_tick(base_model: str) -> None:
    """The persisted tick job's function (the job store keeps its import path)."""
    daemon = _DAEMONS.get(base_model)
    if daemon is None:
        log.warning("tick for %s, which no daemon in this process serves", base_model)
        return
    daemon.tick()

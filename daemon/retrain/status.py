"""What `specloop status` and the daemon's /status report: per base model, the champion (and whether
engines bench it) and the challenger (with its approval), pending approvals, the last runs and alias
moves, and when the next tick is due.

Read from the registry and the state database only, so it works with no daemon running.
Not here: printing (`daemon/retrain/cli.py`), serving (`daemon/retrain/http.py`).
"""

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, MetaData, Table, select
from sqlalchemy.exc import NoSuchTableError

from specloop.daemon.retrain.history import PromotionHistory
from specloop.daemon.retrain.run_log import RunLog
from specloop.storage.registry import CHALLENGER, CHAMPION, Approval, DrafterRegistry, DrafterVersion

_JOBS_TABLE = "apscheduler_jobs"  # APScheduler's SQLAlchemyJobStore default


def tick_job_id(base_model: str) -> str:
    """The id of a base model's persisted tick job."""
    return f"retrain-tick:{base_model}"


def base_models(db: Engine) -> list[str]:
    """Every base model the state database knows, from its runs and history."""
    found = {r.base_model for r in RunLog(db).runs()} | {e.base_model for e in PromotionHistory(db).events()}
    return sorted(found)


def status(db: Engine, registry: DrafterRegistry | None, base_model: str, runs: int = 5,
           events: int = 10) -> dict[str, Any]:
    report: dict[str, Any] = {"base_model": base_model, "next_tick": _iso(next_tick(db, base_model))}
    if registry is not None:
        champion = registry.by_alias(base_model, CHAMPION)
        challenger = registry.by_alias(base_model, CHALLENGER)
        report["champion"] = _version(champion)
        report["challenger"] = _version(challenger)
        report["pending_approvals"] = [v.label for v in registry.versions(base_model)
                                       if v.approval is Approval.PENDING and CHALLENGER in v.aliases]
    report["last_runs"] = [{"run_id": r.run_id, "started_at": _iso(r.started_at), "finished_at": _iso(r.finished_at),
                            "outcome": r.outcome.value, "step": r.step, "version": r.version, "detail": r.detail,
                            "seconds": r.timings} for r in RunLog(db).runs(base_model, limit=runs)]
    report["history"] = [{"at": _iso(e.at), "action": e.action.value, "version": e.version, "previous": e.previous,
                          "actor": e.actor, "reason": e.reason} for e in PromotionHistory(db).events(base_model,
                                                                                                      limit=events)]
    return report


def next_tick(db: Engine, base_model: str) -> datetime | None:
    """The persisted tick job's next run time, read from APScheduler's table without a scheduler."""
    try:
        jobs = Table(_JOBS_TABLE, MetaData(), autoload_with=db)
    except NoSuchTableError:
        return None
    with db.connect() as conn:
        due = conn.execute(select(jobs.c.next_run_time).where(jobs.c.id == tick_job_id(base_model))).scalar()
    return None if due is None else datetime.fromtimestamp(due, UTC)


def _version(v: DrafterVersion | None) -> dict[str, Any] | None:
    if v is None:
        return None
    return {"version": v.label, "tau_challenger": v.tau_challenger, "tau_champion": v.tau_champion,
            "approval": None if v.approval is None else v.approval.value, "gate_reason": v.tags.get("gate_reason"),
            "run": v.tags.get("retrain_run"), "speed_over_suffix": v.speed_over_suffix,
            # engines draft with suffix decoding alone while it is benched (engine/server/drafter_follower.py)
            "benched": v.benched}


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat(timespec="seconds")

"""Retention, applied by the daemon once an hour: traces older than their tenant's `retention_days`
(or the daemon's default), run directories older than the daemon's run retention, and live-τ
samples older than theirs. Each pass that removes anything appends an `expire` entry to the consent
audit log, with what went.

An expired run directory keeps its lineage (`storage/dataset_copies.py`: which drafter version it
registered, which erasures touched it, and who its training split held), so that a later erasure
still names the drafters trained on a subject. The run in progress is never expired.

Not here: the rewrite of trace files (`storage/expiry.py`), Kafka's copies (they expire by the
topics' retention, `storage/broker.py`), erasure (`erasures.py`).
"""

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from specloop.consent.audit import append_audit
from specloop.consent.tenants import parse_tenants
from specloop.daemon.retrain.live_tau import LiveTau
from specloop.daemon.retrain.run import run_started
from specloop.storage.dataset_copies import expire_run
from specloop.storage.expiry import expire_traces

log = logging.getLogger(__name__)


@dataclass
class Retention:
    traces_root: Path
    work_dir: Path
    live: LiveTau
    audit_log: Path
    tenant_days: Mapping[str, float]  # tenants with their own retention_days
    trace_days: float | None  # everyone else's; None: kept
    run_days: float | None
    live_tau_days: float | None
    every_s: float = 3600.0
    last: float = float("-inf")

    def __call__(self, current_run: str | None = None, now: datetime | None = None) -> dict | None:
        """One pass, when an hour has gone since the last; the audit entry written (None: nothing went)."""
        if time.monotonic() - self.last < self.every_s:
            return None
        self.last = time.monotonic()
        now = now or datetime.now(UTC)
        done = {"traces": self._traces(now), "runs": self._runs(now, current_run),
                "live_tau_samples": 0 if self.live_tau_days is None else
                self.live.expire(now - timedelta(days=self.live_tau_days))}
        if not (done["traces"]["rows_removed"] or done["runs"] or done["live_tau_samples"]):
            return None
        log.info("retention: %d trace rows, %d run directories, %d live-τ samples expired",
                 done["traces"]["rows_removed"], len(done["runs"]), done["live_tau_samples"])
        return append_audit(self.audit_log, "expire", "daemon", **done)

    def _traces(self, now: datetime) -> dict:
        if not self.traces_root.is_dir():
            return {"rows_removed": 0, "files_rewritten": 0}
        cutoffs = {t: now - timedelta(days=d) for t, d in self.tenant_days.items()}
        default = None if self.trace_days is None else now - timedelta(days=self.trace_days)
        result = expire_traces(self.traces_root, cutoffs, default)
        return {"rows_removed": result.rows_removed, "files_rewritten": len(result.files_rewritten),
                "default_days": self.trace_days, "tenant_days": dict(self.tenant_days)}

    def _runs(self, now: datetime, current_run: str | None) -> list[str]:
        if self.run_days is None or not self.work_dir.is_dir():
            return []
        cutoff = now - timedelta(days=self.run_days)
        expired = []
        for run_dir in sorted(p for p in self.work_dir.iterdir() if p.is_dir() and p.name != current_run):
            started = run_started(run_dir.name)
            if started is not None and started < cutoff and expire_run(run_dir):
                expired.append(run_dir.name)
        return expired


def tenant_retention(tenants_file: Path | None) -> dict[str, float]:
    """The tenants with their own `retention_days` in the tenants file (none without a file)."""
    if tenants_file is None:
        return {}
    return {t.name: t.retention_days for t in parse_tenants(tenants_file).tenants if t.retention_days is not None}

"""The daemon's retention pass on real files and a real state database: old traces by tenant, old
run directories (not the one running), old live-τ samples; audited; at most once an hour."""

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from specloop.daemon.retrain.live_tau import EngineSample, LiveTau, VersionCounters
from specloop.daemon.retrain.retention import Retention, tenant_retention
from specloop.daemon.retrain.state_db import open_state
from specloop.storage.dataset import OUTPUT_COLUMNS
from specloop.storage.layout import hive_dir, sink_file_name, write_parquet_atomic
from specloop.storage.schema import to_arrow
from tests.storage.traces import make_trace

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


def _run(work: Path, started: datetime) -> Path:
    run = work / f"{started:%Y%m%d-%H%M%S}-abcdef"
    write_parquet_atomic(run / "dataset" / "train.parquet", to_arrow([make_trace()]).select(list(OUTPUT_COLUMNS)))
    return run


def test_one_pass_expires_what_is_past_retention_and_audits_it(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: acme\n    retention_days: 60\n  - name: globex\n")
    root, work = tmp_path / "traces", tmp_path / "runs"
    write_parquet_atomic(hive_dir(root, "fp-test", "2026-04-22") / sink_file_name("traces", 0, 0), to_arrow([
        make_trace("acme-40d", created_at=NOW - 40 * DAY), make_trace("globex-40d", created_at=NOW - 40 * DAY,
                                                                      tenant="globex")]))
    old_run, running, recent = _run(work, NOW - 40 * DAY), _run(work, NOW - 41 * DAY), _run(work, NOW - DAY)
    (work / "drafters").mkdir()  # the champion cache: not a run
    live = LiveTau(open_state(f"sqlite:///{tmp_path / 'state.db'}"))
    for at in (NOW - 40 * DAY, NOW - DAY):
        live.record([EngineSample("http://e1", at, "v1", {"v1": VersionCounters(10, 5)})])
    retention = Retention(root, work, live, tmp_path / "audit.jsonl", tenant_retention(tenants), trace_days=30,
                          run_days=30, live_tau_days=30)

    entry = retention(current_run=running.name, now=NOW)

    assert entry["traces"]["rows_removed"] == 1  # globex's, by the default; acme keeps 60 days
    assert entry["runs"] == [old_run.name]
    assert entry["live_tau_samples"] == 1
    assert not (old_run / "dataset").exists()
    assert (running / "dataset" / "train.parquet").exists() and (recent / "dataset" / "train.parquet").exists()
    assert json.loads((tmp_path / "audit.jsonl").read_text())["event"] == "expire"
    assert retention(now=NOW + 40 * DAY) is None  # the next pass waits an hour


def test_nothing_expired_writes_no_audit_entry(tmp_path: Path) -> None:
    live = LiveTau(open_state(f"sqlite:///{tmp_path / 'state.db'}"))
    retention = Retention(tmp_path / "traces", tmp_path / "runs", live, tmp_path / "audit.jsonl", {}, None, None, None)
    assert retention(now=NOW) is None
    assert not (tmp_path / "audit.jsonl").exists()


def test_retention_settings_are_bounded(tmp_path: Path) -> None:
    import pytest
    from pydantic import ValidationError

    from specloop.daemon.retrain.settings import DaemonSettings

    with pytest.raises(ValidationError, match="run_retention_days"):
        DaemonSettings(policy=tmp_path / "p.yaml", registry="sqlite:///x.db", run_retention_days=1e12)

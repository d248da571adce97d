"""The append-only consent audit log."""

import json
import stat
from pathlib import Path

from specloop.consent.audit import append_audit


def test_audit_log_appends_private_lines(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "audit.jsonl"
    append_audit(path, "grant", "a", n=1)
    append_audit(path, "revoke", "b", n=2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["event"], x["actor"], x["n"]) for x in lines] == [("grant", "a", 1), ("revoke", "b", 2)]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

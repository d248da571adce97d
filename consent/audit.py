"""The consent audit log: an append-only JSON-lines file of grants, revocations and erasures.

Each entry is one line written with a single O_APPEND write and fsynced before returning, so an
entry the caller was told about survives a crash and concurrent writers never interleave lines.
Entries name subjects by pseudonym only. This module does not rotate or read the log.
"""

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def append_audit(path: Path, event: str, actor: str, **fields: Any) -> dict[str, Any]:
    """Append `{"at", "event", "actor", **fields}` as one line; return it as written (plain JSON)."""
    entry = {"at": datetime.now(UTC).isoformat(), "event": event, "actor": actor, **fields}
    line = (json.dumps(entry, default=str, sort_keys=True) + "\n").encode()
    created = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        written = os.write(fd, line)
        assert written == len(line), f"short write to {path}"
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        _fsync_dir(path.parent)
    return json.loads(line)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

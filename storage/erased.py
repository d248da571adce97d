"""The erased-subjects journal: which (tenant, subject) had their traces erased, and when.

One JSON line per erasure in `<traces root>/_erasures.jsonl`, appended and fsynced by the eraser
while it holds the root's maintenance lock. Everything that writes or copies traces applies it to
rows that reach it later: a row of an erased (tenant, subject) created at or before the erasure is
dropped, wherever it comes from (a sink batch in flight, a Kafka replay after a crash, a dataset
built from files read before the erasure). A row created after the erasure belongs to a consent
granted again later and is kept. Subjects are pseudonyms; the journal holds no content and is kept
for ever, like the consent registry.

This module is not the eraser (`specloop.storage.erasure`) and does not decide who is erased.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from specloop.storage.layout import append_json_line

log = logging.getLogger(__name__)

JOURNAL_NAME = "_erasures.jsonl"
# A row created up to this long after its subject's erasure is still erased: `created_at` is the
# engine's clock, `erased_at` the eraser's, and a trace in flight must not land because the
# engine's clock runs ahead. A consent granted again within it loses those minutes of traces.
CLOCK_MARGIN = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class Erasure:
    erasure_id: str
    tenant: str
    subject: str
    erased_at: datetime


def journal_path(root: Path) -> Path:
    return root / JOURNAL_NAME


def record_erasure(root: Path, tenant: str, subject: str, at: datetime | None = None) -> Erasure:
    """Append one erasure durably (one O_APPEND write, fsynced) and return it."""
    erasure = Erasure(uuid.uuid4().hex, tenant, subject, at or datetime.now(UTC))
    append_json_line(journal_path(root), {"erasure_id": erasure.erasure_id, "tenant": tenant, "subject": subject,
                                          "erased_at": erasure.erased_at.isoformat()})
    return erasure


class JournalCorrupt(RuntimeError):
    """A complete journal line that cannot be read: which subject it erased is unknown, so nothing
    that applies the journal may go on (not a ValueError: no caller may take it for bad input)."""


def read_erasures(root: Path) -> list[Erasure]:
    """Every erasure recorded under `root`, oldest first; none when the journal does not exist.

    An unterminated last line is an append cut short (a full disk): it recorded nothing, since its
    eraser failed, and is skipped. A corrupt complete line raises `JournalCorrupt`: which subject it
    erased cannot be known, and applying the rest would let that one's traces land.
    """
    path = journal_path(root)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if lines[-1]:
        log.warning("%s ends in an unterminated line (an append cut short); it is ignored", path)
    found = []
    for number, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            found.append(Erasure(d["erasure_id"], d["tenant"], d["subject"], datetime.fromisoformat(d["erased_at"])))
        except (ValueError, KeyError, TypeError) as e:
            raise JournalCorrupt(f"{path}:{number}: unreadable erasure record ({e}); repair the journal") from e
    return found


def without_erased(table: pa.Table, erasures: list[Erasure]) -> tuple[pa.Table, int]:
    """`table` less its rows of erased subjects created at or before their erasure (`CLOCK_MARGIN`
    after it); rows removed.

    `table` needs `tenant` and `subject` columns; without `created_at` every row of an erased
    subject goes (a copy whose age is unknown is treated as older than the erasure).
    """
    if not erasures or table.num_rows == 0:
        return table, 0
    latest: dict[tuple[str, str], datetime] = {}
    for e in erasures:
        key = (e.tenant, e.subject)
        latest[key] = max(latest.get(key, e.erased_at), e.erased_at)
    candidates = pc.is_in(table["subject"], pa.array(sorted({s for _, s in latest}), pa.string()))
    if not pc.any(candidates).as_py():
        return table, 0
    tenants = table["tenant"].to_pylist()
    subjects = table["subject"].to_pylist()
    created = table["created_at"].to_pylist() if "created_at" in table.column_names else [None] * table.num_rows
    erased = [
        (t, s) in latest and (c is None or c <= latest[(t, s)] + CLOCK_MARGIN)
        for t, s, c in zip(tenants, subjects, created, strict=True)
    ]
    kept = table.filter(pc.invert(pa.array(erased, pa.bool_())))
    return kept, table.num_rows - kept.num_rows

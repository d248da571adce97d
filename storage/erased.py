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
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from specloop.storage.layout import append_json_line

JOURNAL_NAME = "_erasures.jsonl"


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


def read_erasures(root: Path) -> list[Erasure]:
    """Every erasure recorded under `root`, oldest first; none when the journal does not exist."""
    path = journal_path(root)
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        if line.strip():  # a crash mid-append leaves no partial line: one write per entry
            d = json.loads(line)
            found.append(Erasure(d["erasure_id"], d["tenant"], d["subject"], datetime.fromisoformat(d["erased_at"])))
    return found


def without_erased(table: pa.Table, erasures: list[Erasure]) -> tuple[pa.Table, int]:
    """`table` less its rows of erased subjects created at or before their erasure; rows removed.

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
        (t, s) in latest and (c is None or c <= latest[(t, s)])
        for t, s, c in zip(tenants, subjects, created, strict=True)
    ]
    kept = table.filter(pc.invert(pa.array(erased, pa.bool_())))
    return kept, table.num_rows - kept.num_rows

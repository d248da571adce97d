"""Revocation with erasure: revoke a subject's consent, remove their stored traces, audit it.

Order matters: consent is revoked first, so no new trace of the subject is captured (or used by a
dataset build) while Parquet files are rewritten; then the trace eraser rewrites every affected
file without the subject's rows, journals the erasure for copies still in flight, and scrubs the
datasets retraining runs built; then one audit entry records who asked, what was revoked, how many
rows and files were rewritten and which drafter versions were trained on the subject. A failed
erasure is audited as failed and re-raised, and can simply be run again.

This module does not touch Parquet, and consent does not import storage: the eraser
(`specloop.storage.erasure.erase_subject`) is handed in by the code above both that joins them, the
engine's trace hook (`engine/server/trace_hook.py`, for the admin API) and the command line root
(`daemon/cli.py`, for `specloop consent revoke --erase`).
"""

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from specloop.consent.audit import append_audit
from specloop.consent.registry import ConsentRecord, ConsentRegistry

# (traces root, tenant, subject pseudonym, the daemon's work dir) -> a dataclass reporting what was
# rewritten. A work dir that does not exist here (a daemon on another machine) has nothing to scrub.
TraceEraser = Callable[[Path, str, str, Path], Any]


def revoke_and_erase(
    registry: ConsentRegistry,
    erase_traces: TraceEraser,
    traces_root: Path,
    work_dir: Path,
    tenant: str,
    subject: str,
    audit_log: Path,
    actor: str,
    purpose: str | None = None,
) -> tuple[list[ConsentRecord], dict[str, Any]]:
    """Revoke `subject`'s consent (one purpose, or all) and erase their traces.

    Returns the records revoked now and the audit entry written.

    `subject` is the pseudonym; resolve a raw user id with `Pseudonymizer.subject` first.
    """
    revoked = registry.revoke(tenant, subject, purpose, at=datetime.now(UTC))
    what = {"tenant": tenant, "subject": subject, "purpose": purpose,
            "consents_revoked": [r.consent_id for r in revoked], "traces_root": str(traces_root),
            "work_dir": str(work_dir)}
    try:
        result = erase_traces(traces_root, tenant, subject, work_dir)
    except Exception as exc:
        append_audit(audit_log, "revoke_and_erase", actor, status="failed", error=repr(exc), **what)
        raise
    assert dataclasses.is_dataclass(result), type(result)
    entry = append_audit(
        audit_log, "revoke_and_erase", actor, status="ok", erasure=dataclasses.asdict(result), **what
    )
    return revoked, entry

"""The dataset builder: DuckDB over the trace Parquet files -> `train.parquet`, `eval.parquet`, manifest.

Selection, in order: one base-model fingerprint, a created_at window `[since, until)`, dedupe by
trace_id (the copy that finished first), an inner join against a consent snapshot (a trace is kept
only when its consent record, matched on consent_id, tenant and subject, was granted by the time
the trace was created and is neither revoked nor expired at `as_of`), then the newest `limit`
traces. The split is by `md5(trace_id)`, so a trace stays on the same side across builds and
DuckDB versions. Outputs carry `trace_id`, `created_at`, `tenant`, `subject` and `consent_id` (so a
run can re-check consent before it registers and promotes, and a dataset can be scrubbed by
subject), `endpoint` (for evaluation by slice), `prompt_token_ids`, `response_token_ids` in arrival
order (created_at, then trace_id): the contest replays held-out traces as they arrived, since suffix
decoding learns from earlier ones.
`manifest.json` is written last and records counts, filters, the content digest and the consent
snapshot digest.

The consent snapshot is an Arrow table with columns consent_id, tenant, subject, purpose,
policy_version, granted_at, expires_at, revoked_at (as `specloop.consent.registry.ConsentRegistry.snapshot`
returns). This module is not the trainer and does not read the consent registry itself.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from specloop.storage.erased import read_erasures, without_erased
from specloop.storage.layout import live_files, write_json_atomic, write_parquet_atomic

CONSENT_COLUMNS = (
    "consent_id",
    "tenant",
    "subject",
    "purpose",
    "policy_version",
    "granted_at",
    "expires_at",
    "revoked_at",
)
OUTPUT_COLUMNS = ("trace_id", "created_at", "tenant", "subject", "consent_id", "endpoint", "prompt_token_ids",
                  "response_token_ids")
_SPLIT_BUCKETS = 1_000_000

# Each statement runs separately: DuckDB binds parameters only in the last statement of a batch.
_WINDOW = """
CREATE TEMP TABLE windowed AS
    SELECT trace_id, created_at, finished_at, tenant, subject, consent_id, endpoint, prompt_token_ids,
        response_token_ids
    FROM read_parquet($files, hive_partitioning = false)
    WHERE base_model = $base_model AND created_at >= $since AND created_at < $until
"""
_DEDUPE = """
CREATE TEMP VIEW unique_traces AS
    SELECT * FROM windowed
    QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY finished_at, created_at) = 1
"""
_CONSENTED = """
CREATE TEMP TABLE consented AS
    SELECT t.* FROM unique_traces t JOIN consent c
        ON c.consent_id = t.consent_id AND c.tenant = t.tenant AND c.subject = t.subject
    WHERE c.granted_at <= t.created_at
        AND (c.revoked_at IS NULL OR c.revoked_at > $as_of)
        AND (c.expires_at IS NULL OR c.expires_at > $as_of)
"""


@dataclass(frozen=True, slots=True)
class DatasetManifest:
    base_model: str
    since: str | None
    until: str | None
    as_of: str
    limit: int | None
    eval_fraction: float
    source_files: int
    rows_in_window: int
    unique_traces: int
    consented_traces: int
    train_rows: int
    eval_rows: int
    content_digest: str
    consent_snapshot_digest: str


def build_dataset(
    root: Path,
    output: Path,
    consent: pa.Table,
    *,
    base_model: str,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = None,
    eval_fraction: float = 0.1,
    as_of: datetime | None = None,
) -> DatasetManifest:
    """Write `output/{train,eval}.parquet` and `output/manifest.json`; returns the manifest."""
    as_of = as_of or datetime.now(UTC)
    _check_arguments(consent, since, until, as_of, limit, eval_fraction)
    files = [str(p) for p in live_files(root, base_model)]
    if not files:
        raise ValueError(f"base_model: no trace files for {base_model!r} under {root}")
    con = _select_consented(files, consent, base_model, since, until, as_of)
    train, evaluation = _split(con, limit, eval_fraction)
    # A build that read the files just before an erasure rewrote them must not keep the subject: the
    # journal is written before the rewrite, so reading it now closes that window.
    erasures = read_erasures(root)
    train, evaluation = without_erased(train, erasures)[0], without_erased(evaluation, erasures)[0]
    manifest = DatasetManifest(
        base_model=base_model,
        since=since.isoformat() if since else None,
        until=until.isoformat() if until else None,
        as_of=as_of.isoformat(),
        limit=limit,
        eval_fraction=eval_fraction,
        source_files=len(files),
        rows_in_window=_count(con, "windowed"),
        unique_traces=_count(con, "unique_traces"),
        consented_traces=_count(con, "consented"),
        train_rows=train.num_rows,
        eval_rows=evaluation.num_rows,
        content_digest=_digest(train, evaluation),
        consent_snapshot_digest=_digest(consent.sort_by("consent_id")),
    )
    write_parquet_atomic(output / "train.parquet", train)
    write_parquet_atomic(output / "eval.parquet", evaluation)
    write_json_atomic(output / "manifest.json", asdict(manifest))
    return manifest


def count_consented(root: Path, consent: pa.Table, *, base_model: str, since: datetime | None = None,
                    as_of: datetime | None = None) -> int:
    """Unique consented traces of `base_model` created at or after `since`, selected exactly as
    `build_dataset` selects them (the retrain trigger counts new traces with it); 0 with no files."""
    as_of = as_of or datetime.now(UTC)
    _check_arguments(consent, since, None, as_of, None, 0.0)
    files = [str(p) for p in live_files(root, base_model)]
    if not files:
        return 0
    return _count(_select_consented(files, consent, base_model, since, None, as_of), "consented")


def _select_consented(files: list[str], consent: pa.Table, base_model: str, since: datetime | None,
                      until: datetime | None, as_of: datetime) -> duckdb.DuckDBPyConnection:
    """A connection holding `windowed`, `unique_traces` and `consented` for these files."""
    con = duckdb.connect()
    con.register("consent", consent.select(list(CONSENT_COLUMNS)))
    window = {
        "files": files,
        "base_model": base_model,
        "since": since or datetime(1970, 1, 1, tzinfo=UTC),
        "until": until or datetime(9999, 1, 1, tzinfo=UTC),
    }
    con.execute(_WINDOW, window)
    con.execute(_DEDUPE)
    con.execute(_CONSENTED, {"as_of": as_of})
    return con


def _check_arguments(
    consent: pa.Table,
    since: datetime | None,
    until: datetime | None,
    as_of: datetime,
    limit: int | None,
    eval_fraction: float,
) -> None:
    missing = [c for c in CONSENT_COLUMNS if c not in consent.column_names]
    if missing:
        raise ValueError(f"consent: snapshot lacks columns {missing}")
    for name, value in (("since", since), ("until", until), ("as_of", as_of)):
        if value is not None and value.tzinfo is None:
            raise ValueError(f"{name}: must be timezone-aware")
    if since and until and since >= until:
        raise ValueError(f"since: {since} is not before until {until}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: must be >= 1, got {limit}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction: must be in [0, 1), got {eval_fraction}")


def _split(con: duckdb.DuckDBPyConnection, limit: int | None, eval_fraction: float) -> tuple[pa.Table, pa.Table]:
    columns = ", ".join(OUTPUT_COLUMNS)
    query = f"""
        WITH chosen AS (
            SELECT * FROM consented ORDER BY created_at DESC, trace_id {"LIMIT $limit" if limit else ""}
        )
        SELECT {columns} FROM chosen
        WHERE (md5_number(trace_id) % {_SPLIT_BUCKETS}) {{}} $cut
        ORDER BY created_at, trace_id
    """
    params: dict[str, object] = {"cut": int(eval_fraction * _SPLIT_BUCKETS)}
    if limit:
        params["limit"] = limit
    # A relation's Arrow output, not a DB-API cursor's: duckdb 2 warns that the cursor copies the rows.
    train = con.sql(query.format(">="), params=params).to_arrow_table()
    evaluation = con.sql(query.format("<"), params=params).to_arrow_table()
    return train, evaluation


def _count(con: duckdb.DuckDBPyConnection, view: str) -> int:
    return con.execute(f"SELECT count(*) FROM {view}").fetchall()[0][0]


def _digest(*tables: pa.Table) -> str:
    """sha256 over the tables' Arrow IPC stream: equal content, equal digest."""
    digest = hashlib.sha256()
    for table in tables:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        digest.update(sink.getvalue().to_pybytes())
    return "sha256:" + digest.hexdigest()

"""What erasure and retention cost on a trace store of a given size: how long each holds the traces
root's lock (the sink waits that long to write), and what the sink's journal filter adds per batch.

A synthetic store as the sink writes it: `--traces` traces of `--tokens` prompt + response tokens
over `--days` days, 3 partitions, one file per partition per `--batch` traces, `--subjects` subjects
of one tenant. Measured, each in the same run:
- erasing one ordinary subject (their traces spread at random: in about `traces / subjects` rows);
- erasing the heaviest subject (one trace in 20, so in nearly every file);
- the sink's filter on one batch with `--journal` erasures recorded (a long-lived deployment);
- one retention pass that expires the oldest third of the days.
Erasure holds the lock while it journals and lists the subject's files (`listing_seconds`, its
longest hold), then once per file it rewrites; expiry per file (`storage/expiry.py`).

Writes `benchmarks/results/erasure_cost.json`. Not a test; about a minute at 100,000 traces.
"""

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.append(str(Path(__file__).resolve().parents[1]))  # `benchmarks`; last, so no folder shadows a package
from benchmarks.machine import describe  # noqa: E402
from specloop.storage.erased import Erasure, read_erasures, record_erasure, without_erased  # noqa: E402
from specloop.storage.erasure import _listed, erase_subject  # noqa: E402
from specloop.storage.expiry import expire_traces  # noqa: E402
from specloop.storage.layout import hive_dir, live_files, sink_file_name, write_parquet_atomic  # noqa: E402
from specloop.storage.schema import ARROW_SCHEMA  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "erasure_cost.json"
TENANT = "acme"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
PARTITIONS = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens, and as many response tokens")
    p.add_argument("--days", type=int, default=30)
    p.add_argument("--batch", type=int, default=2_000, help="traces per sink file")
    p.add_argument("--subjects", type=int, default=5_000)
    p.add_argument("--journal", type=int, default=1_000, help="erasures already recorded, for the filter")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def subject(i: int) -> str:
    return f"{i:064x}"


def batch_table(rng: random.Random, count: int, day: datetime, subjects: list[str], tokens: int) -> pa.Table:
    """`count` traces of one sink batch, in the sink's Arrow schema."""
    ids = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 49152, size=(count, 2 * tokens), dtype=np.int32)
    created = [day + timedelta(seconds=rng.randrange(86_400)) for _ in range(count)]
    columns = {
        "schema_version": [1] * count, "trace_id": [uuid.uuid4().hex for _ in range(count)],
        "created_at": created, "finished_at": [c + timedelta(seconds=1) for c in created],
        "tenant": [TENANT] * count, "subject": [rng.choice(subjects) for _ in range(count)],
        "consent_id": ["consent"] * count, "consent_policy_version": ["v1"] * count,
        "base_model": ["fp-bench"] * count, "drafter_version": [None] * count,
        "endpoint": ["/v1/chat/completions"] * count,
        "prompt_token_ids": list(ids[:, :tokens]), "response_token_ids": list(ids[:, tokens:]),
        "sampling": [{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": tokens, "seed": None,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}] * count,
        "spec": [{"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}] * count,
        "finish_reason": ["length"] * count,
    }
    columns = {name: columns[name] if name in columns else [None] * count for name in ARROW_SCHEMA.names}
    return pa.table(columns, schema=ARROW_SCHEMA)


def build_store(root: Path, args: argparse.Namespace, heavy: str) -> None:
    rng = random.Random(0)
    ordinary = [subject(i) for i in range(1, args.subjects)]
    per_day = args.traces // args.days
    offset = 0
    for d in range(args.days):
        day = T0 + timedelta(days=d)
        for start in range(0, per_day, args.batch):
            count = min(args.batch, per_day - start)
            # One trace in 20 is the heavy subject's: they are in nearly every file.
            table = batch_table(rng, count, day, ordinary * 19 + [heavy] * len(ordinary), args.tokens)
            path = hive_dir(root, "fp-bench", f"{day:%Y-%m-%d}") / sink_file_name("traces", offset % PARTITIONS, offset)
            write_parquet_atomic(path, table)
            offset += count


def timed(call):  # noqa: ANN001, ANN202 (a benchmark helper)
    started = time.perf_counter()
    result = call()
    return result, round(time.perf_counter() - started, 3)


def main() -> None:
    args = parse_args()
    heavy = subject(0)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "traces"
        _, build_s = timed(lambda: build_store(root, args, heavy))
        files = live_files(root)
        store_mb = sum(p.stat().st_size for p in files) / 1e6
        # The longest single hold of the lock: journalling and listing, a scan of every file's keys.
        _, listing_s = timed(lambda: _listed(root, Erasure("probe", TENANT, heavy, datetime.now(UTC))))
        ordinary, ordinary_s = timed(lambda: erase_subject(root, TENANT, subject(7)))
        heaviest, heavy_s = timed(lambda: erase_subject(root, TENANT, heavy))
        for i in range(args.journal):
            record_erasure(root, TENANT, subject(10_000 + i))
        sink_batch = batch_table(random.Random(1), args.batch, datetime.now(UTC), [subject(i) for i in range(50)],
                                 args.tokens)
        journal, read_s = timed(lambda: read_erasures(root))
        _, filter_s = timed(lambda: without_erased(sink_batch, journal))
        cutoff = T0 + timedelta(days=args.days // 3)
        expired, expiry_s = timed(lambda: expire_traces(root, {}, cutoff))
    result = {
        "machine": describe(),
        "store": {"traces": args.traces, "tokens_per_trace": 2 * args.tokens, "files": len(files),
                  "megabytes": round(store_mb, 1), "build_seconds": build_s},
        "listing_seconds": listing_s,
        "erase_ordinary_subject": {"seconds": ordinary_s, "rows": ordinary.rows_removed,
                                   "files_rewritten": len(ordinary.files_rewritten)},
        "erase_heaviest_subject": {"seconds": heavy_s, "rows": heaviest.rows_removed,
                                   "files_rewritten": len(heaviest.files_rewritten)},
        "sink_filter": {"journal_entries": len(journal), "batch_traces": args.batch,
                        "read_journal_ms": round(read_s * 1000, 3), "filter_ms": round(filter_s * 1000, 3)},
        "expiry_pass": {"seconds": expiry_s, "rows": expired.rows_removed,
                        "files_rewritten": len(expired.files_rewritten)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()

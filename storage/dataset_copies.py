"""Copies of traces made by dataset builds, found and scrubbed by subject, with their lineage.

A retraining run builds its dataset under `<work dir>/<run>/` (`dataset/`, or `bootstrap/<fingerprint>/`
when it answered another base model's prompts): Parquet files with each trace's `tenant`, `subject`,
`created_at` and `trace_id` (`specloop.storage.dataset.OUTPUT_COLUMNS`). Once the run registers a
drafter it writes `<run>/registered.json` naming the version (`record_lineage`), so a scrub can say
which drafter versions were trained on a subject without asking MLflow.

`scrub_subject` rewrites every such file without an erased subject's rows (the journal's rule,
`specloop.storage.erased.without_erased`; older datasets without a `subject` column by trace id),
atomically, reports the runs whose training split held the subject, and appends to each affected
run's `erasures.jsonl` (erasure id, rows removed, whether from the training split): the run keeps
the record that its drafter learned from someone since erased, after the rows are gone. Files that
are not trace copies (drafter weights, manifests with counts only) are left alone. This module does not decide
what happens to the drafters trained on a subject (the daemon's `on_erasure` policy does).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specloop.storage.erased import Erasure, without_erased
from specloop.storage.layout import append_json_line, read_json_lines, write_json_atomic, write_parquet_atomic

LINEAGE_NAME = "registered.json"
RUN_ERASURES_NAME = "erasures.jsonl"
TRAIN_FILE = "train.parquet"
# What an expired run keeps of its training split: who was in it (tenant, pseudonym), so that a later
# erasure still names the drafter it trained.
TRAIN_SUBJECTS_FILE = "train-subjects.parquet"
_KEPT_WHEN_EXPIRED = {LINEAGE_NAME, RUN_ERASURES_NAME, TRAIN_SUBJECTS_FILE}


@dataclass(frozen=True, slots=True)
class Lineage:
    """A run, the drafter version it registered (None: none yet), the dataset directory it trained
    on (relative to the run; None: not known yet) and the version it warm-started from, of its own base
    model or, for a base model's first drafter, of `warm_start_base_model`."""

    run_id: str
    base_model: str | None
    version: str | None
    dataset: str | None = None
    warm_start_from: str | None = None
    warm_start_base_model: str | None = None  # None: `base_model`

    @property
    def parent(self) -> tuple[str | None, str] | None:
        """(base model, version) of the drafter this run's weights started from; None: a new drafter."""
        if self.warm_start_from is None:
            return None
        return self.warm_start_base_model or self.base_model, self.warm_start_from

    @property
    def label(self) -> str:
        return f"{self.run_id}: " + ("nothing registered" if self.version is None else
                                     f"{self.base_model} v{self.version}")


@dataclass(frozen=True, slots=True)
class ScrubResult:
    files_rewritten: tuple[Path, ...]
    rows_removed: int
    trained_on: tuple[Lineage, ...]  # runs whose training split held the subject


def record_lineage(run_dir: Path, lineage: Lineage) -> None:
    """Note in the run's directory which drafter version its dataset trained, and from what."""
    write_json_atomic(run_dir / LINEAGE_NAME, {"base_model": lineage.base_model, "version": lineage.version,
                                               "dataset": lineage.dataset, "warm_start_from": lineage.warm_start_from,
                                               "warm_start_base_model": lineage.warm_start_base_model})


def read_lineage(run_dir: Path) -> Lineage:
    path = run_dir / LINEAGE_NAME
    if not path.exists():
        return Lineage(run_dir.name, None, None)
    d = json.loads(path.read_text())
    return Lineage(run_dir.name, d["base_model"], d["version"], d.get("dataset"), d.get("warm_start_from"),
                   d.get("warm_start_base_model"))


def _trained_on(run_dir: Path, path: Path) -> bool:
    """Whether `path` is (a summary of) the training split this run trained on; before the run
    registers, which split it will train on is not known, so every one counts."""
    if path.name == TRAIN_SUBJECTS_FILE:
        return True
    dataset = read_lineage(run_dir).dataset
    return path.name == TRAIN_FILE and (dataset is None or path.parent == run_dir / dataset)


def scrub_subject(work_dir: Path, erasure: Erasure, trace_ids: frozenset[str] = frozenset()) -> ScrubResult:
    """Rewrite every dataset copy under `work_dir` without `erasure`'s subject (and `trace_ids`)."""
    rewritten: list[Path] = []
    per_run: dict[str, list[int | bool]] = {}  # run -> [rows removed, whether from a training split]
    if not work_dir.is_dir():
        return ScrubResult((), 0, ())
    for path in sorted(work_dir.rglob("*.parquet")):
        if path.name.startswith("."):  # a writer's temp file, gone when it finishes
            continue
        count = _scrub_file(path, erasure, trace_ids)
        if count:
            rewritten.append(path)
            name = path.relative_to(work_dir).parts[0]
            run = per_run.setdefault(name, [0, False])
            run[0] += count
            run[1] = run[1] or _trained_on(work_dir / name, path)
    for run, (count, trained) in per_run.items():
        append_json_line(work_dir / run / RUN_ERASURES_NAME,
                         {"erasure_id": erasure.erasure_id, "rows_removed": count, "trained": trained})
    lineage = tuple(read_lineage(work_dir / run) for run, (_, trained) in sorted(per_run.items()) if trained)
    return ScrubResult(tuple(rewritten), sum(int(c) for c, _ in per_run.values()), lineage)


def expire_run(run_dir: Path) -> int:
    """Delete a run's datasets, checkpoints and scratch, keeping its lineage: `registered.json`,
    `erasures.jsonl` and who its training split held (`train-subjects.parquet`). Bytes freed."""
    trains = [p for p in run_dir.rglob(TRAIN_FILE)
              if _trained_on(run_dir, p) and {"tenant", "subject"} <= set(pq.read_schema(p).names)]
    if trains:
        subjects = pa.concat_tables(pq.read_table(p, columns=["tenant", "subject"]) for p in trains)
        write_parquet_atomic(run_dir / TRAIN_SUBJECTS_FILE, subjects.group_by(["tenant", "subject"]).aggregate([]))
    freed = 0
    for entry in sorted(run_dir.iterdir()):
        if entry.name in _KEPT_WHEN_EXPIRED:
            continue
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        freed += sum(p.stat().st_size for p in files)
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return freed


def erasures_of(run_dir: Path) -> list[str]:
    """The erasure ids that removed rows from this run's datasets (training or evaluation), oldest first."""
    return list(dict.fromkeys(e["erasure_id"] for e in _run_erasures(run_dir)))


def _run_erasures(run_dir: Path) -> list[dict]:
    return read_json_lines(run_dir / RUN_ERASURES_NAME)


def trained_on_erased(run_dir: Path) -> list[str]:
    """The erasure ids of subjects this run's training split held, oldest first."""
    return list(dict.fromkeys(e["erasure_id"] for e in _run_erasures(run_dir) if e["trained"]))


def _scrub_file(path: Path, erasure: Erasure, trace_ids: frozenset[str]) -> int:
    """Rows removed from `path` (0: the file was not touched)."""
    names = set(pq.read_schema(path).names)
    if {"tenant", "subject"} <= names:
        keys = pq.read_table(path, columns=["tenant", "subject"])
        if not pc.any(pc.equal(keys["subject"], erasure.subject)).as_py():
            return 0
        table = pq.read_table(path)
        kept, count = without_erased(table, [erasure])
    elif "trace_id" in names and trace_ids:
        table = pq.read_table(path)
        kept = table.filter(pc.invert(pc.is_in(table["trace_id"], pa.array(sorted(trace_ids), pa.string()))))
        count = table.num_rows - kept.num_rows
    else:
        return 0
    if count:
        write_parquet_atomic(path, kept)
    return count

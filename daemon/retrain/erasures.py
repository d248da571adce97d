"""The daemon's part of erasure: finish each erasure where the eraser could not reach, report which
drafters were trained on the subject, and act on them as the policy's `data.on_erasure` says.

Erasure itself (`specloop.storage.erasure`, from `specloop consent revoke --erase` or the engine's
admin API) journals the erasure in the traces root and rewrites the trace files; it scrubs the run
datasets only when the daemon's work directory is on its machine, which no shipped deployment
does (the engines do not mount it). So at every watch the daemon, for each journal entry past the
last one it applied (the cursor, per base model, in the work directory):

1. rewrites the trace files by it again (an eraser that crashed after journalling left them), and
   scrubs every run dataset of the subject, each affected run noting the erasure in its
   `erasures.jsonl` (a run still training then ends with nothing registered, `run.py`);
2. appends an `erasure_lineage` entry to the consent audit log: the runs whose training split held
   the subject and the drafter versions they registered.

And at every watch it acts on the registry: a version is tainted when its run's training split held
an erased subject, or when it was warm-started from a tainted version (its weights carry what it
started from), another base model's included (a base model's first drafter, `run.py`). `keep` does
nothing; `flag` sets the version's `trained_on_erased` tag to the number of erased subjects behind
it; `retire` flags it and, when it holds `champion`, moves the alias back along the
`previous_champion` chain to the newest version not tainted (or removes it), recorded in
the promotion history, and removes `challenger` from a tainted version. Every step is idempotent.

Not here: the erasure of trace files (storage), the consent registry, the policy's parsing.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from specloop.consent.audit import append_audit
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.policy import OnErasure
from specloop.storage.dataset_copies import (
    LINEAGE_NAME,
    RUN_ERASURES_NAME,
    Lineage,
    read_lineage,
    scrub_subject,
    trained_on_erased,
)
from specloop.storage.erased import Erasure, read_erasures
from specloop.storage.erasure import apply_erasure
from specloop.storage.layout import write_json_atomic
from specloop.storage.registry import CHALLENGER, CHAMPION, DrafterRegistry, DrafterVersion, Tag

log = logging.getLogger(__name__)

Version = tuple[str | None, str]  # (base model, version number)


@dataclass
class ErasureFollowUp:
    base_model: str
    traces_root: Path
    work_dir: Path
    registry: DrafterRegistry
    history: PromotionHistory
    on_erasure: OnErasure
    audit_log: Path

    _acted_on: tuple | None = None  # what `act` last saw: it calls MLflow only when that changes

    def __call__(self) -> list[str]:
        """Both halves, in order (tests; the daemon runs them on two threads)."""
        self.apply_journal()
        return self.act()

    def apply_journal(self) -> None:
        """The journal's new entries, in order, each recorded in the cursor once done. One that fails
        stops the pass (logged); the next pass tries it again."""
        for erasure in self._new_entries():
            self._finish(erasure)
            write_json_atomic(self._cursor(), {"last": erasure.erasure_id})

    def act(self) -> list[str]:
        """The policy on every tainted version; the labels of the versions flagged now. On the watch
        thread, with rollbacks: two threads must not move `champion` at once."""
        if self.on_erasure is OnErasure.KEEP:
            return []
        seen = self._state()
        if seen == self._acted_on:
            return []
        acted = self._act()
        self._acted_on = seen
        return acted

    def _state(self) -> tuple:
        """What `_act`'s answer depends on, on disk: each run's lineage and erasure records."""
        if not self.work_dir.is_dir():
            return ()
        return tuple((p.name, *(_size(p / name) for name in (LINEAGE_NAME, RUN_ERASURES_NAME)))
                     for p in sorted(self.work_dir.iterdir()) if p.is_dir())

    def _new_entries(self) -> list[Erasure]:
        journal = read_erasures(self.traces_root)
        path = self._cursor()
        last = json.loads(path.read_text()).get("last") if path.exists() else None
        ids = [e.erasure_id for e in journal]
        return journal[ids.index(last) + 1:] if last in ids else journal  # unknown: all again, harmlessly

    def _finish(self, erasure: Erasure) -> None:
        rows = apply_erasure(self.traces_root, erasure) if self.traces_root.is_dir() else 0
        scrubbed = scrub_subject(self.work_dir, erasure)
        if rows or scrubbed.rows_removed:
            log.warning("erasure %s: %d trace rows and %d run dataset rows the eraser had not reached",
                        erasure.erasure_id, rows, scrubbed.rows_removed)
        lineages = self._lineages()
        trained = [x for x in lineages if erasure.erasure_id in trained_on_erased(self.work_dir / x.run_id)]
        descendants = sorted((v for v, ids in self._tainted(lineages).items() if erasure.erasure_id in ids), key=int)
        append_audit(self.audit_log, "erasure_lineage", "daemon", erasure_id=erasure.erasure_id,
                     tenant=erasure.tenant, subject=erasure.subject, trace_rows_removed=rows,
                     dataset_rows_removed=scrubbed.rows_removed, trained_on=[x.label for x in trained],
                     drafter_versions=[f"{x.base_model} v{x.version}" for x in trained if x.version is not None],
                     tainted_versions=[f"{self.base_model} v{v}" for v in descendants],
                     on_erasure=self.on_erasure.value)

    def _lineages(self) -> list[Lineage]:
        if not self.work_dir.is_dir():
            return []
        return [read_lineage(p) for p in sorted(self.work_dir.iterdir()) if p.is_dir()]

    def _tainted(self, lineages: list[Lineage]) -> dict[str, set[str]]:
        """This base model's versions -> the erasure ids behind each. A first drafter warm-started from
        another base model's carries that one's too, so every base model's runs are followed."""
        known = {(x.base_model, x.version): x for x in lineages if x.version is not None}
        return {v: ids for (base_model, v), ids in _tainted(known, self.work_dir).items()
                if base_model == self.base_model}

    def _act(self) -> list[str]:
        """Flag (and under `retire`, retire) every tainted version of this base model."""
        acted = []
        tainted = self._tainted(self._lineages())
        for version, erased in sorted(tainted.items(), key=lambda item: int(item[0])):
            try:
                v = self.registry.version(self.base_model, version)
            except ValueError as e:  # deleted in MLflow since: nothing left to flag
                log.warning("erasure follow-up: %s", e)
                continue
            if v.tags.get(Tag.TRAINED_ON_ERASED) != str(len(erased)):
                self.registry.set_tags(self.base_model, version, {Tag.TRAINED_ON_ERASED: str(len(erased))})
                log.warning("%s was trained on %d subjects erased since: flagged", v.label, len(erased))
                acted.append(v.label)
            if self.on_erasure is OnErasure.RETIRE:
                self._retire(v, len(erased), set(tainted))
        return acted

    def _retire(self, v: DrafterVersion, erased: int, tainted: set[str]) -> None:
        if CHALLENGER in v.aliases:
            self.registry.delete_alias(self.base_model, CHALLENGER)
            log.warning("challenger %s of %s removed: trained on erased subjects", v.label, self.base_model)
        if CHAMPION not in v.aliases:
            return
        reason = f"retired: trained on {erased} subjects since erased (policy data.on_erasure: retire)"
        previous = self._newest_clean_predecessor(v, tainted)
        self.registry.set_tags(self.base_model, v.version, {Tag.ROLLED_BACK: reason})
        if previous is None:
            self.registry.delete_alias(self.base_model, CHAMPION)
        else:
            self.registry.set_alias(self.base_model, CHAMPION, previous.version)
        log.warning("champion of %s: %s -> %s: %s", self.base_model, v.label,
                    "none" if previous is None else previous.label, reason)
        self.history.record(self.base_model, Action.ROLLED_BACK, v.label, reason,
                            previous=None if previous is None else previous.label)

    def _newest_clean_predecessor(self, v: DrafterVersion, tainted: set[str]) -> DrafterVersion | None:
        seen = {v.version}
        while (before := v.tags.get(Tag.PREVIOUS_CHAMPION)) is not None and before not in seen:
            seen.add(before)
            v = self.registry.version(self.base_model, before)
            if before not in tainted and Tag.TRAINED_ON_ERASED not in v.tags:
                return v
        return None

    def _cursor(self) -> Path:
        return self.work_dir / f"_erasures-applied-{self.base_model}.json"


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else -1


def _tainted(lineages: dict[Version, Lineage], work_dir: Path) -> dict[Version, set[str]]:
    """(base model, version) -> the erasure ids behind it: its own run's, and those of what it
    warm-started from (followed iteratively: a long-lived deployment's chain is hundreds deep)."""
    own = {v: set(trained_on_erased(work_dir / x.run_id)) for v, x in lineages.items()}
    memo: dict[Version, set[str]] = {}
    for version in lineages:
        chain: list[Version] = []
        v: Version | None = version
        while v is not None and v in lineages and v not in memo and v not in chain:
            chain.append(v)
            v = lineages[v].parent
        inherited = memo.get(v, set()) if v is not None else set()
        for link in reversed(chain):
            inherited = own[link] | inherited
            memo[link] = inherited
    return {v: ids for v, ids in memo.items() if ids}

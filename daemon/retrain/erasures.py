"""The daemon's part of erasure: scrub what reached a run's dataset late, and act on the drafters
trained on an erased subject as the policy's `data.on_erasure` says.

Erasure itself (`specloop.storage.erasure`, from `specloop consent revoke --erase` or the engine's
admin API) rewrites the trace files, journals the erasure in the traces root and, when the daemon's
work directory is on the same machine, scrubs the run datasets there and records in each affected
run's directory that its training split held the subject. The daemon, at every watch, reads the
journal past the entries it has applied (a cursor per base model in the work directory) and:

1. scrubs every run dataset of those subjects again: a daemon on another machine, or a dataset
   build that read the trace files just before the erasure rewrote them, leaves copies only it sees;
2. for each run of this base model whose training split held an erased subject and that registered
   a version: `keep` records nothing more; `flag` sets the version's `trained_on_erased` tag to the
   number of erased subjects it learned from (the registry is where an auditor looks);
   `retire` flags it and, when it is the champion, moves `champion` back along its
   `previous_champion` chain to the newest version not flagged (the shipped drafter never is), or
   removes the alias when there is none, recorded in the promotion history. The next run trains
   without the subject in any case: their consent is revoked before their traces are erased.

Every step is idempotent, so two daemons of one base model, or a restart mid-way, do no harm.
Not here: the erasure of trace files (storage), the consent registry, the policy's parsing.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.policy import OnErasure
from specloop.storage.dataset_copies import read_lineage, scrub_subject, trained_on_erased
from specloop.storage.erased import read_erasures
from specloop.storage.layout import write_json_atomic
from specloop.storage.registry import CHAMPION, DrafterRegistry, DrafterVersion, Tag

log = logging.getLogger(__name__)


@dataclass
class ErasureFollowUp:
    base_model: str
    traces_root: Path
    work_dir: Path
    registry: DrafterRegistry
    history: PromotionHistory
    on_erasure: OnErasure

    def __call__(self) -> list[str]:
        """Apply the journal's new entries; the labels of the versions flagged or retired now."""
        journal = read_erasures(self.traces_root)
        applied = self._applied()
        if len(journal) <= applied:
            return []
        for erasure in journal[applied:]:
            scrubbed = scrub_subject(self.work_dir, erasure)
            if scrubbed.rows_removed:
                log.warning("erasure %s: %d rows scrubbed from %d run dataset files the eraser did not reach",
                            erasure.erasure_id, scrubbed.rows_removed, len(scrubbed.files_rewritten))
        acted = [] if self.on_erasure is OnErasure.KEEP or not self.work_dir.is_dir() else self._act()
        write_json_atomic(self._cursor(), {"applied": len(journal)})
        return acted

    def _act(self) -> list[str]:
        acted = []
        for run_dir in sorted(p for p in self.work_dir.iterdir() if p.is_dir()):
            erased = trained_on_erased(run_dir)
            lineage = read_lineage(run_dir)
            if not erased or lineage.version is None or lineage.base_model != self.base_model:
                continue
            v = self.registry.version(self.base_model, lineage.version)
            if v.tags.get(Tag.TRAINED_ON_ERASED) != str(len(erased)):
                self.registry.set_tags(self.base_model, v.version, {Tag.TRAINED_ON_ERASED: str(len(erased))})
                log.warning("%s was trained on %d erased subjects (run %s): flagged", v.label, len(erased),
                            run_dir.name)
                acted.append(v.label)
            if self.on_erasure is OnErasure.RETIRE and CHAMPION in v.aliases:
                self._retire(v, len(erased))
        return acted

    def _retire(self, v: DrafterVersion, erased: int) -> None:
        reason = f"retired: trained on {erased} subjects since erased (policy data.on_erasure: retire)"
        previous = self._newest_clean_predecessor(v)
        self.registry.set_tags(self.base_model, v.version, {Tag.ROLLED_BACK: reason})
        if previous is None:
            self.registry.delete_alias(self.base_model, CHAMPION)
        else:
            self.registry.set_alias(self.base_model, CHAMPION, previous.version)
        log.warning("champion of %s: %s -> %s: %s", self.base_model, v.label,
                    "none" if previous is None else previous.label, reason)
        self.history.record(self.base_model, Action.ROLLED_BACK, v.label, reason,
                            previous=None if previous is None else previous.label)

    def _newest_clean_predecessor(self, v: DrafterVersion) -> DrafterVersion | None:
        seen = {v.version}
        while (before := v.tags.get(Tag.PREVIOUS_CHAMPION)) is not None and before not in seen:
            seen.add(before)
            v = self.registry.version(self.base_model, before)
            if Tag.TRAINED_ON_ERASED not in v.tags:
                return v
        return None

    def _cursor(self) -> Path:
        return self.work_dir / f"_erasures-applied-{self.base_model}.json"

    def _applied(self) -> int:
        path = self._cursor()
        return json.loads(path.read_text())["applied"] if path.exists() else 0

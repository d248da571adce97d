"""The contest: champion and challenger replayed on the same held-out traces, n-gram lookup beside them.

Each contender is replayed as serving drafts with it: the drafter combined with n-gram lookup
(`engine/speculation/build.py`), at the challenger's block size. n-gram lookup alone is the
baseline, and what serving does when there is no champion. The held-out traces are the run's
eval split: recent, consented, never trained on. With slices (tenant, endpoint), each slice is
replayed on its own and the whole is the sum of the slices, so slices cost nothing extra.

Not here: the replay itself (`daemon/evaluation/replay.py`), the decision (`gate.py`).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specloop.daemon.evaluation.replay import ReplayStats, replay
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.proposer import Proposer
from specloop.storage.sequences import TokenSequence, digest

log = logging.getLogger(__name__)

NGRAM = "ngram"
CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class Contest:
    eval_set: str  # digest of the held-out sequences, in order
    sequences: int
    block_size: int
    stats: dict[str, ReplayStats]  # contender -> replay over the whole set
    slices: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # slice -> contender -> τ

    def tau(self, contender: str) -> float:
        return self.stats[contender].tau

    @property
    def tau_baseline(self) -> float:
        """τ of what serves today: the champion if there is one, else n-gram lookup."""
        return self.tau(CHAMPION if CHAMPION in self.stats else NGRAM)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow: τ, acceptance rate and per-position acceptance of each contender."""
        out: dict[str, float] = {}
        for name, s in self.stats.items():
            report = s.to_json()
            out[f"tau_{name}"] = report["tau"]
            out[f"acceptance_rate_{name}"] = report["acceptance_rate"]
            for i, a in enumerate(report["per_position_acceptance"]):
                out[f"acceptance_pos{i}_{name}"] = a
        for slice_name, by_contender in self.slices.items():
            for name, tau in by_contender.items():
                out[f"tau_{name}_{slice_name}"] = tau["tau"]
        return out


def run_contest(target: Transformer, base_model: str, heldout: list[TokenSequence], challenger: Path,
                champion: Path | None, slice_keys: list[str] | None = None) -> Contest:
    """Replay every contender on `heldout`; `slice_keys[i]` names the slice of `heldout[i]` (None: one slice)."""
    assert slice_keys is None or len(slice_keys) == len(heldout)
    challenger_proposer = _served(target, base_model, challenger)
    block = challenger_proposer.block_size
    contenders: dict[str, Proposer] = {NGRAM: build_proposer("ngram", target, block_size=block)}
    if champion is not None:
        contenders[CHAMPION] = _served(target, base_model, champion, block)
    contenders[CHALLENGER] = challenger_proposer
    groups = _slices(heldout, slice_keys)
    per_slice: dict[str, dict[str, ReplayStats]] = {name: {} for name in groups}
    for contender, proposer in contenders.items():
        for name, seqs in groups.items():
            per_slice[name][contender] = replay(proposer, seqs, target)
        log.info("contest: %s replayed on %d held-out traces", contender, len(heldout))
    whole = {c: _pooled([per_slice[s][c] for s in groups]) for c in contenders}
    slices = {} if slice_keys is None else {s: {c: {"tau": st.tau, "sequences": st.sequences}
                                                for c, st in by.items()} for s, by in per_slice.items()}
    return Contest(digest(heldout), len(heldout), block, whole, slices)


def _served(target: Transformer, base_model: str, artifact: Path, block_size: int | None = None) -> Proposer:
    drafter = load_drafter(artifact, base_model, target.device, target.dtype).drafter
    return build_proposer("combined", target, drafter, block_size)


def _slices(heldout: list[TokenSequence], keys: list[str] | None) -> dict[str, list[TokenSequence]]:
    if keys is None:
        return {"all": heldout}
    groups: dict[str, list[TokenSequence]] = {}
    for seq, key in zip(heldout, keys, strict=True):
        groups.setdefault(key, []).append(seq)
    return dict(sorted(groups.items()))


def _pooled(parts: list[ReplayStats]) -> ReplayStats:
    assert parts and len({p.block_size for p in parts}) == 1
    per_position = tuple(sum(col) for col in zip(*(p.accepted_per_position for p in parts), strict=True))
    return ReplayStats(parts[0].block_size, sum(p.sequences for p in parts), sum(p.steps for p in parts),
                       sum(p.committed for p in parts), per_position)

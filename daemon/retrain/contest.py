"""The contest: champion and challenger replayed on the same held-out traces, suffix decoding alone beside
them, judged on decode speed.

Each contender is replayed as serving drafts with it by default: the drafter with suffix decoding
(`DEFAULT_LEARNED_KIND`, `engine/speculation/kinds.py`), at the challenger's block size. The baseline
is what serves: the champion, unless it is not `serve_margin` (the gate's `min_relative_gain`) faster
than suffix decoding alone, or there is none: then suffix decoding alone. The champion is tagged with
that verdict, and engines bench a benched champion (`engine/server/drafter_follower.py`). Every
contender's suffix cache starts warmed with the run's training traces (the recent traffic a serving cache holds when a
new drafter starts serving), and the held-out traces (the run's eval split: recent, consented,
never trained on) are replayed in arrival order, so each learns from the ones before it as serving
would. Speed is modelled from this machine's measured cost of a step's parts by batch, width and
drafted rows (`daemon/evaluation/step_cost.py`), per trace, so the gain between two contenders gets
a paired confidence interval (`daemon/evaluation/speed_gain.py`). τ is reported
beside it. With slices (tenant, endpoint), each slice's τ is reported too.

Not here: the replay itself (`daemon/evaluation/replay.py`), the decision (`gate.py`).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specloop.daemon.evaluation.replay import NAMESPACE, ReplayStats, replay
from specloop.daemon.evaluation.speed_gain import SpeedGain, paired_speed_gain
from specloop.daemon.evaluation.step_cost import CostModel, StepCost
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.build import build_proposer, dflash_of
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND
from specloop.engine.speculation.proposer import Proposer
from specloop.engine.speculation.suffix_cache import SuffixCache
from specloop.storage.sequences import TokenSequence, digest

log = logging.getLogger(__name__)

SUFFIX = "suffix"
CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class Contest:
    eval_set: str  # digest of the held-out sequences, in order
    sequences: int
    block_size: int  # the drafters' block; suffix decoding's own drafts may be longer
    stats: dict[str, ReplayStats]  # contender -> replay over the whole set, with modelled seconds per trace
    costs: dict[str, StepCost]  # contender -> its measured step cost
    slices: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # slice -> contender -> τ
    serve_margin: float = 0.0  # the speed gain over suffix decoding alone a drafter needs to serve

    def benched(self, contender: str) -> bool:
        """Whether `contender` + suffix decoding falls short of `serve_margin` over suffix decoding alone."""
        return self.over_suffix(contender).gain < self.serve_margin

    def tau(self, contender: str) -> float:
        return self.stats[contender].tau

    def over_suffix(self, contender: str, confidence: float = 0.95) -> SpeedGain:
        """`contender`'s decode speed (its drafter + suffix decoding) over suffix decoding alone's."""
        return paired_speed_gain(self.stats[SUFFIX].seconds, self.stats[contender].seconds, confidence)

    @property
    def baseline(self) -> str:
        """What serves: the champion unless it is benched, else suffix decoding alone (no champion, or
        one not `serve_margin` faster than it)."""
        return CHAMPION if CHAMPION in self.stats and not self.benched(CHAMPION) else SUFFIX

    @property
    def tau_baseline(self) -> float:
        return self.tau(self.baseline)

    def speed_gain(self, confidence: float = 0.95) -> SpeedGain:
        """The challenger's decode speed over the baseline's, paired by trace."""
        return paired_speed_gain(self.stats[self.baseline].seconds, self.stats[CHALLENGER].seconds, confidence)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow: τ, modelled tokens/s, acceptance rate and per-position acceptance of each
        contender, each one's step cost and speed gain over suffix decoding alone, and the challenger's
        speed gain over the baseline with its interval."""
        out: dict[str, float] = self.speed_gain().to_json()
        for name in self.stats.keys() - {SUFFIX}:
            out[f"speed_over_suffix_{name}"] = self.over_suffix(name).gain
        for name, s in self.stats.items():
            report = s.to_json()
            out[f"tau_{name}"] = report["tau"]
            out[f"tokens_per_s_{name}"] = report["modelled_tokens_per_s"]
            out[f"acceptance_rate_{name}"] = report["acceptance_rate"]
            for i, a in enumerate(report["per_position_acceptance"]):
                out[f"acceptance_pos{i}_{name}"] = a
            out.update({f"step_{k}_{name}": v for k, v in self.costs[name].to_json().items()})
        for slice_name, by_contender in self.slices.items():
            for name, tau in by_contender.items():
                out[f"tau_{name}_{slice_name}"] = tau["tau"]
        return out


def run_contest(target: Transformer, base_model: str, heldout: list[TokenSequence], challenger: Path,
                champion: Path | None, slice_keys: list[str] | None = None,
                earlier: list[TokenSequence] = (), serve_margin: float = 0.0) -> Contest:
    """Replay every contender on `heldout`, each with a suffix cache warmed by `earlier`; `slice_keys[i]`
    names the slice of `heldout[i]` (None: one slice); a drafter needs `serve_margin` over suffix
    decoding alone to serve."""
    assert slice_keys is None or len(slice_keys) == len(heldout)
    challenger_proposer = _served(target, base_model, challenger, earlier)
    dflash = dflash_of(challenger_proposer)
    assert dflash is not None
    block = dflash.block_size  # the champion drafts blocks as long as the challenger's
    contenders: dict[str, Proposer] = {SUFFIX: build_proposer("suffix", target, suffix_cache=_warmed(earlier))}
    if champion is not None:
        contenders[CHAMPION] = _served(target, base_model, champion, earlier, block)
    contenders[CHALLENGER] = challenger_proposer
    model = CostModel(target, [list(s.tokens) for s in heldout[:8]], NAMESPACE)
    stats, costs = {}, {}
    for contender, proposer in contenders.items():
        costs[contender] = model.cost(proposer)
        stats[contender] = replay(proposer, heldout, target, cost=costs[contender])
        log.info("contest: %s replayed on %d held-out traces: τ %.3f, %.1f tokens/s modelled", contender,
                 len(heldout), stats[contender].tau, stats[contender].tokens_per_s)
    return Contest(digest(heldout), len(heldout), block, stats, costs, _slice_taus(stats, slice_keys), serve_margin)


def _warmed(earlier: list[TokenSequence]) -> SuffixCache:
    cache = SuffixCache()
    for seq in earlier:
        cache.add(NAMESPACE, list(seq.tokens))
    return cache


def _served(target: Transformer, base_model: str, artifact: Path, earlier: list[TokenSequence],
            block_size: int | None = None) -> Proposer:
    drafter = load_drafter(artifact, base_model, target.device, target.dtype).drafter
    return build_proposer(DEFAULT_LEARNED_KIND, target, drafter, block_size, _warmed(earlier))


def _slice_taus(stats: dict[str, ReplayStats], keys: list[str] | None) -> dict[str, dict[str, dict[str, float]]]:
    """Per slice and contender, τ over the slice's traces (from each trace's committed tokens and steps)."""
    if keys is None:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, s in stats.items():
        for key in sorted(set(keys)):
            rows = [i for i, k in enumerate(keys) if k == key]
            steps = sum(s.steps_per_trace[i] for i in rows)
            out.setdefault(key, {})[name] = {"tau": sum(s.tokens[i] for i in rows) / steps if steps else 1.0,
                                              "sequences": len(rows)}
    return out

"""Offline acceptance: replay speculative decoding over the target's stored greedy outputs.

For greedy decoding the target's output is fixed, so a verify step can be replayed without running
the target's verify pass: the proposer drafts k tokens from the committed prefix, the longest
prefix of drafts equal to the stored continuation is accepted, and the target's token after it
(the bonus) is committed too. τ is committed tokens per verify step (bonus included, so
1 ≤ τ ≤ block size), exactly what serving sees for greedy. The prefill's first token is not a
verify step and is not counted. The last step of a sequence may commit fewer than a+1 tokens when
the stored response ends (there is nothing left to verify).

Target hidden states, for proposers that need them, come from one cache-less causal pass over
each whole stored sequence: causality makes position p's state the same as serving computes it
after committing p, up to floating-point noise.

Averaging acceptance over every possible anchor instead would overstate τ when acceptances come in
bursts (n-gram lookup on held-out HumanEval: 5.10 averaged over anchors vs 2.29 replayed).
`compare` runs several drafters, n-gram lookup and their combinations over one set, as
`specloop eval-drafter` and the daemon's gate report them, and can add the same measurement by real
speculative generation (`daemon/evaluation/live.py`).
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specloop.daemon.evaluation.live import generate_stats
from specloop.daemon.evaluation.step_cost import HeldRows, StepCost
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.verify_cost import WithStep, best_num_drafts
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer, draft_lengths
from specloop.engine.speculation.suffix_cache import SuffixCache
from specloop.storage.sequences import TokenSequence, digest

NAMESPACE = "replay"  # one tenant: every replayed sequence shares a suffix cache


@dataclass(frozen=True)
class ReplayStats:
    block_size: int
    sequences: int
    steps: int  # verify steps
    committed: int  # tokens committed by verify steps
    accepted_per_position: tuple[int, ...]  # [k]: steps whose draft i was accepted
    # Per sequence replayed, in order: the tokens its verify steps committed, its verify steps, and
    # (with a step cost, else empty) the modelled seconds of its prefill and of those steps, each
    # step's cost shared equally by the sequences in it.
    tokens: tuple[int, ...] = ()
    steps_per_trace: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    @property
    def tau(self) -> float:
        return self.committed / self.steps if self.steps else 1.0

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.accepted / (self.steps * (self.block_size - 1)) if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """Modelled decode speed: committed tokens per modelled second (None without a step cost)."""
        return sum(self.tokens) / sum(self.seconds) if self.seconds else None

    def to_json(self) -> dict:
        per_pos = [a / self.steps if self.steps else 0.0 for a in self.accepted_per_position]
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position_acceptance": per_pos,
                "block_size": self.block_size, "sequences": self.sequences, "verify_steps": self.steps,
                "committed_tokens": self.committed, "accepted_draft_tokens": self.accepted,
                **({"modelled_tokens_per_s": self.tokens_per_s} if self.seconds else {})}


def _taps(target: Transformer, tap_layers: tuple[int, ...], rows: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    S = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    tokens = tokens.to(target.device)
    with torch.no_grad():
        _, taps = target(tokens, taps=tap_layers)  # each [B, S, H]; right padding never reaches real rows
    return tokens, taps


def _replay_group(proposer: Proposer, target: Transformer | None, seqs: list[TokenSequence],
                  accepted: list[int], cost: StepCost | None) -> tuple[list[int], list[int], list[float]]:
    """Per sequence: (verify steps, tokens committed, modelled seconds)."""
    rows = [s.tokens for s in seqs]
    steps, done_by, seconds = [0] * len(rows), [0] * len(rows), [0.0] * len(rows)
    proposer.allocate(len(rows), max(len(r) for r in rows) + proposer.block_size)
    for b in range(len(rows)):
        proposer.begin(b, NAMESPACE)
    if proposer.tap_layers:
        assert target is not None, "this proposer needs the target's hidden states"
        tokens, taps = _taps(target, proposer.tap_layers, rows)
        proposer.observe(list(range(len(rows))), [0] * len(rows), taps, tokens)
    # committed[b]: tokens committed so far (prompt + the prefill's first output token).
    committed = [len(s.prompt) + 1 for s in seqs]
    held = HeldRows() if cost is not None and cost.dflash_write is not None else None  # DFlash's unwritten rows
    if cost is not None:
        seconds = [cost.prefill_seconds(len(s.prompt), held, b) for b, s in enumerate(seqs)]
    while True:
        live = [b for b, r in enumerate(rows) if committed[b] < len(r)]
        if not live:
            break
        last = torch.tensor([rows[b][committed[b] - 1] for b in live], dtype=torch.long)
        proposed = proposer.propose(live, [committed[b] - 1 for b in live], last,
                                    [rows[b][:committed[b]] for b in live])  # [B, k]
        if cost is not None:  # as serving verifies: only as many draft columns as pay (verify_cost.py)
            lengths = draft_lengths(proposed)
            confidence = proposer.last_confidence
            confidence = torch.ones(proposed.shape) if confidence is None else confidence
            # The rest of the step priced as serving's running mean of it would find it: the lookup.
            step = WithStep(cost.target, cost.lookup(len(live)))
            keep = best_num_drafts(confidence, lengths, step, cost.exact_drafts(len(live)))
            proposed = proposed[:, :keep]
            learned = [live[i] for i in _learned_rows(proposer, len(live))]
            written = [held.take(b) for b in learned] if held is not None else []
            step_s = cost.seconds(len(live), keep + 1, len(learned), written)
            if held is not None:  # the pass's positions are observed: held, or written past the limit
                step_s += cost.write_seconds([held.observe(b, committed[b] - 1, keep + 1) for b in live])
            for b in live:
                seconds[b] += step_s / len(live)
        verified, accepted_now = [], []  # per live row, as serving tells the proposer (`LLMEngine._verify`)
        for b, draft, drafted in zip(live, proposed.tolist(), draft_lengths(proposed).tolist(), strict=True):
            truth = rows[b][committed[b]:committed[b] + len(draft)]
            n = 0
            while n < len(truth) and draft[n] == truth[n]:
                n += 1
            # Where the stored response ends among the accepted drafts, nothing past it is committed,
            # and serving counts only what it commits (`LLMEngine._verify`): done - 1 accepted drafts.
            done = min(n + 1, len(rows[b]) - committed[b])
            for i in range(done - 1):
                accepted[i] += 1
            verified.append(min(drafted, len(rows[b]) - committed[b] - 1))
            accepted_now.append(done - 1)
            committed[b] += done
            done_by[b] += done
            steps[b] += 1
        proposer.verified(verified, accepted_now)
    for b in range(len(rows)):
        proposer.release(b, list(rows[b]))
    return steps, done_by, seconds


def _learned_rows(proposer: Proposer, batch: int) -> list[int]:
    """The rows (batch indices) of the last `propose` that DFlash ran on (and so costs)."""
    if isinstance(proposer, CombinedProposer):
        return proposer.last_learned
    return list(range(batch)) if isinstance(proposer, DFlashProposer) else []


def warm(proposer: Proposer, sequences: list[TokenSequence]) -> None:
    """Let `proposer` see `sequences` served and finished, as serving would have before the replayed
    ones arrived (suffix decoding caches them; every other proposer forgets them)."""
    for s in sequences:
        proposer.begin(0, NAMESPACE)
        proposer.release(0, list(s.tokens))


def replay(proposer: Proposer, sequences: list[TokenSequence], target: Transformer | None = None,
           batch_size: int = 8, cost: StepCost | None = None) -> ReplayStats:
    """Replay greedy speculative decoding of every sequence's stored response with `proposer`, in
    order, `batch_size` at a time: each group's sequences finish before the next group starts.
    With `cost`, also each sequence's modelled decode seconds (`step_cost.py`)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    accepted = [0] * (proposer.block_size - 1)
    steps, tokens, seconds = [], [], []
    for i in range(0, len(sequences), batch_size):  # a sequence without a response takes no verify step
        s, t, sec = _replay_group(proposer, target, sequences[i:i + batch_size], accepted, cost)
        steps, tokens, seconds = steps + s, tokens + t, seconds + sec
    return ReplayStats(proposer.block_size, sum(len(s.response) >= 1 for s in sequences), sum(steps), sum(tokens),
                       tuple(accepted), tuple(tokens), tuple(steps), tuple(seconds) if cost else ())


def compare(target: Transformer, fingerprint: str, sequences: list[TokenSequence], drafters: list[Path],
            ngram_block_size: int | None, combined: bool = True, block_size: int | None = None,
            min_match: int = 3, batch_size: int = 8, live_concurrency: int | None = None) -> dict:
    """Replay every drafter (refusing any trained for another fingerprint), n-gram lookup at
    `ngram_block_size` and suffix decoding (None: skip both), and each drafter combined with each
    lookup, on the same set, in order (a suffix cache starts empty and learns from the sequences
    replayed before). With `live_concurrency`, each is also run by real speculative generation at
    that concurrency."""
    results = []
    for entry, proposer, needs_target in _contenders(target, fingerprint, drafters, ngram_block_size, combined,
                                                     block_size, min_match):
        stats = replay(proposer, sequences, target if needs_target else None, batch_size)
        entry.update(stats.to_json())
        if live_concurrency is not None:
            entry["generation"] = generate_stats(target, proposer, sequences, live_concurrency)
        results.append(entry)
    return {
        "base_model_fingerprint": fingerprint,
        "set": {"digest": digest(sequences), "sequences": len(sequences),
                "response_tokens": sum(len(s.response) for s in sequences)},
        "results": results,
    }


def _contenders(target: Transformer, fingerprint: str, drafters: list[Path], ngram_block_size: int | None,
                combined: bool, block_size: int | None, min_match: int) -> Iterator[tuple[dict, Proposer, bool]]:
    """(report entry, proposer, needs the target's taps) for everything `compare` measures."""
    # Every artifact is loaded, and its fingerprint checked, before the first replay: a wrong second
    # path otherwise failed only after the first drafter's replay (12 minutes on 72 prompts here).
    artifacts = [(path, load_drafter(path, fingerprint, target.device, target.dtype)) for path in drafters]
    if ngram_block_size is not None:
        yield {"name": f"ngram-b{ngram_block_size}", "kind": "ngram"}, NgramProposer(ngram_block_size), False
        yield {"name": "suffix", "kind": "suffix"}, build_proposer("suffix", target, suffix_cache=SuffixCache()), False
    for path, art in artifacts:
        dflash = DFlashProposer(art.drafter, target, block_size)
        info = {"drafter": str(path), "lineage": {"data_digest": art.lineage.data_digest,
                                                   "steps": art.lineage.steps, "seed": art.lineage.seed}}
        yield {"name": Path(path).name, "kind": "dflash", **info}, dflash, True
        if combined:
            both = CombinedProposer(dflash, NgramProposer(dflash.block_size), min_match)
            yield {"name": f"{Path(path).name}+ngram", "kind": "combined", "min_match": min_match, **info}, both, True
            with_suffix = build_proposer("dflash+suffix", target, art.drafter, block_size, SuffixCache())
            yield {"name": f"{Path(path).name}+suffix", "kind": "dflash+suffix", **info}, with_suffix, True

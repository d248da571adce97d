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
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer
from specloop.storage.sequences import TokenSequence, digest


@dataclass(frozen=True)
class ReplayStats:
    block_size: int
    sequences: int
    steps: int  # verify steps
    committed: int  # tokens committed by verify steps
    accepted_per_position: tuple[int, ...]  # [k]: steps whose draft i was accepted

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

    def to_json(self) -> dict:
        per_pos = [a / self.steps if self.steps else 0.0 for a in self.accepted_per_position]
        return {"tau": self.tau, "acceptance_rate": self.acceptance_rate, "per_position_acceptance": per_pos,
                "block_size": self.block_size, "sequences": self.sequences, "verify_steps": self.steps,
                "committed_tokens": self.committed, "accepted_draft_tokens": self.accepted}


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
                  accepted: list[int]) -> tuple[int, int]:
    k = proposer.block_size - 1
    rows = [s.tokens for s in seqs]
    proposer.allocate(len(rows), max(len(r) for r in rows) + proposer.block_size)
    if proposer.tap_layers:
        assert target is not None, "this proposer needs the target's hidden states"
        tokens, taps = _taps(target, proposer.tap_layers, rows)
        proposer.observe(list(range(len(rows))), [0] * len(rows), taps, tokens)
    # committed[b]: tokens committed so far (prompt + the prefill's first output token).
    committed = [len(s.prompt) + 1 for s in seqs]
    steps = tokens_done = 0
    while True:
        live = [b for b, r in enumerate(rows) if committed[b] < len(r)]
        if not live:
            break
        last = torch.tensor([rows[b][committed[b] - 1] for b in live], dtype=torch.long)
        drafts = proposer.propose(live, [committed[b] - 1 for b in live], last,
                                  [rows[b][:committed[b]] for b in live]).tolist()
        for b, draft in zip(live, drafts, strict=True):
            truth = rows[b][committed[b]:committed[b] + k]
            n = 0
            while n < len(truth) and draft[n] == truth[n]:
                n += 1
            # Where the stored response ends among the accepted drafts, nothing past it is committed,
            # and serving counts only what it commits (`LLMEngine._verify`): done - 1 accepted drafts.
            done = min(n + 1, len(rows[b]) - committed[b])
            for i in range(done - 1):
                accepted[i] += 1
            committed[b] += done
            tokens_done += done
        steps += len(live)
    for b in range(len(rows)):
        proposer.release(b)
    return steps, tokens_done


def replay(proposer: Proposer, sequences: list[TokenSequence], target: Transformer | None = None,
           batch_size: int = 8) -> ReplayStats:
    """Replay greedy speculative decoding of every sequence's stored response with `proposer`."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    seqs = [s for s in sequences if len(s.response) >= 1]
    accepted = [0] * (proposer.block_size - 1)
    steps = committed = 0
    for i in range(0, len(seqs), batch_size):
        s, c = _replay_group(proposer, target, seqs[i:i + batch_size], accepted)
        steps, committed = steps + s, committed + c
    return ReplayStats(proposer.block_size, len(seqs), steps, committed, tuple(accepted))


def compare(target: Transformer, fingerprint: str, sequences: list[TokenSequence], drafters: list[Path],
            ngram_block_size: int | None, combined: bool = True, block_size: int | None = None,
            min_match: int = 3, batch_size: int = 8, live_concurrency: int | None = None) -> dict:
    """Replay every drafter (refusing any trained for another fingerprint), n-gram lookup at
    `ngram_block_size` (None: skip), and each drafter combined with n-gram lookup, on the same set.
    With `live_concurrency`, each is also run by real speculative generation at that concurrency."""
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
    for path, art in artifacts:
        dflash = DFlashProposer(art.drafter, target, block_size)
        info = {"drafter": str(path), "lineage": {"data_digest": art.lineage.data_digest,
                                                   "steps": art.lineage.steps, "seed": art.lineage.seed}}
        yield {"name": Path(path).name, "kind": "dflash", **info}, dflash, True
        if combined:
            both = CombinedProposer(dflash, NgramProposer(dflash.block_size), min_match)
            yield {"name": f"{Path(path).name}+ngram", "kind": "combined", "min_match": min_match, **info}, both, True

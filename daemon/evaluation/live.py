"""Acceptance measured by real speculative generation: the engine, the proposer, the target's verify passes.

Replay (`daemon/evaluation/replay.py`) is cheap and, for greedy, equals serving up to floating-point noise.
This runs the real thing on the same set: every stored prompt is decoded greedily by `LLMEngine`
with the proposer (continuous batching, `max_tokens` = the stored response's length, EOS ignored
so each sequence verifies over the same span as its replay), and τ and per-position acceptance are
summed over the sequences' `SpecStats`. It also counts outputs equal to the stored response token
for token: a losslessness check against the run that made the data. In bf16 a different batch
shape can flip a near-tie in the target's own argmax, after which the two continuations (and their
τ) part ways; in fp32 they agree.

This file does not build proposers or compare them (`daemon/evaluation/replay.py` does).
"""

import time

from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.speculation.proposer import Proposer
from specloop.storage.sequences import TokenSequence


def generate_stats(target: Transformer, proposer: Proposer, sequences: list[TokenSequence],
                   concurrency: int = 8) -> dict:
    """τ, per-position acceptance, exact-match count and decode speed of real speculative generation."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be > 0, got {concurrency}")
    seqs = [s for s in sequences if s.response]
    if not seqs:
        raise ValueError("no sequence with a stored response to generate against")
    max_len = max(len(s.tokens) for s in seqs) + 1
    engine = LLMEngine(target, EngineConfig(num_slots=min(concurrency, len(seqs)), max_len=max_len), (), proposer)
    params = [SamplingParams(max_tokens=len(s.response), temperature=0.0, ignore_eos=True) for s in seqs]
    started = time.perf_counter()
    out = engine.generate([list(s.prompt) for s in seqs], params)
    seconds = time.perf_counter() - started
    spec = SpecStats.pooled(seq.spec for seq in out)
    per_position = spec.accepted_per_position + [0] * (proposer.num_drafts - len(spec.accepted_per_position))
    tokens = sum(len(seq.output_ids) for seq in out)
    return {
        "tau": spec.mean_accepted_length,
        "per_position_acceptance": [a / spec.drafts if spec.drafts else 0.0 for a in per_position],
        "verify_steps": spec.drafts, "accepted_draft_tokens": spec.accepted_tokens, "generated_tokens": tokens,
        "identical_to_stored": sum(list(seq.output_ids) == list(s.response) for seq, s in zip(out, seqs)),
        "sequences": len(seqs), "concurrency": engine.config.num_slots,
        "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 1),
    }

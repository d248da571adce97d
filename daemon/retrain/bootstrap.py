"""A first drafter's data for a new base model: the old model's consented prompts, answered again by
the new one, or, when no model has any, the prompts that ship with specloop.

When the served fingerprint changes (a new model, the old one fine-tuned or quantized to NVFP4), no
old drafter may serve it and its own traces start from zero. Until enough arrive, the daemon trains
from the traffic it already has: the consented traces of the base model with the most of them in the
data window, selected by the same DuckDB builder (consent re-checked), whose prompts the new target
answers greedily. The drafter learns the new target's answers, never the old one's.

The prompts are reused as token ids, as the old model saw them after its chat template. That is
right when the tokenizer and template stayed (a fine-tune, the common case of "alignment drift");
prompts with ids outside the new vocabulary are dropped, and a model with another tokenizer gets
prompts it would not have seen, which still teach the drafter its answers. Responses get at most
`MAX_NEW_TOKENS` (the old response's length when shorter).

With no traces of any model (a fresh deployment serving a model that ships no drafter), the target
answers the first `count` of the shipped prompts instead (`daemon/training/prompt_sets/first-drafter.jsonl`:
one prompt from each of 256 OpenAI `evals` tasks, broad chat as the shipped drafter's data was). They
are no one's data, so they need no consent; the run's held-out share is their last prompts.

Not here: deciding to bootstrap (`run.py`: no champion and too few own traces).
"""

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specloop.daemon.training.prompts import FIRST_DRAFTER, read_prompts
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.storage.dataset import DatasetManifest, build_dataset
from specloop.storage.layout import base_models
from specloop.storage.sequences import TokenSequence

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 256  # the demo traffic's answers are 192 tokens at most; evals answers 256
_SLOTS = 16  # sequences answered together: generation is throughput-bound (92 tok/s at 48, 2 cores)


@dataclass(frozen=True)
class Bootstrapped:
    source: str  # the fingerprint whose prompts were answered again
    manifest: DatasetManifest  # of the source's traces
    train: list[TokenSequence]
    heldout: list[TokenSequence]


@dataclass(frozen=True)
class ShippedAnswers:
    prompts: Path  # the prompt file answered
    train: list[TokenSequence]
    heldout: list[TokenSequence]


def bootstrap(root: Path, consent: pa.Table, target: LoadedModel, *, since: datetime | None, until: datetime,
              limit: int | None, eval_fraction: float, work_dir: Path) -> Bootstrapped | None:
    """The new target's answers to the most-traced other base model's prompts (None: no other has any)."""
    built = []
    for fp in base_models(root):
        if fp == target.fingerprint:
            continue
        manifest = build_dataset(root, work_dir / fp, consent, base_model=fp, since=since, until=until,
                                 limit=limit, eval_fraction=eval_fraction)
        built.append((manifest.consented_traces, fp, manifest))
    if not built or max(built)[0] == 0:
        return None
    _, source, manifest = max(built)
    log.info("bootstrap: answering %d consented prompts of %s with %s", manifest.train_rows + manifest.eval_rows,
             source, target.fingerprint)
    train = _answered(target, work_dir / source / "train.parquet")
    heldout = _answered(target, work_dir / source / "eval.parquet")
    return Bootstrapped(source, manifest, train, heldout)


def shipped_answers(target: LoadedModel, count: int, eval_fraction: float,
                    prompts: Path = FIRST_DRAFTER) -> ShippedAnswers:
    """The target's greedy answers to the first `count` shipped prompts, the last `eval_fraction` of
    them held out."""
    if count < 2:
        raise ValueError(f"count must be at least 2 (one to train on, one held out), got {count}")
    tok = target.tokenizer
    ids = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in read_prompts(prompts, count)]
    log.info("first drafter: %s answers %d shipped prompts", target.fingerprint, len(ids))
    answered = _generate(target, [(p, MAX_NEW_TOKENS) for p in ids])
    cut = len(answered) - held_out(len(answered), eval_fraction)
    return ShippedAnswers(prompts, answered[:cut], answered[cut:])


def held_out(count: int, eval_fraction: float) -> int:
    """How many of `count` answered prompts are held out: at least one, and one less than all."""
    return min(count - 1, max(1, round(count * eval_fraction)))


def _answered(target: LoadedModel, path: Path) -> list[TokenSequence]:
    table = pq.read_table(path, columns=["prompt_token_ids", "response_token_ids"])
    return _generate(target, [(p, min(MAX_NEW_TOKENS, max(1, len(r)))) for p, r in zip(
        table["prompt_token_ids"].to_pylist(), table["response_token_ids"].to_pylist(), strict=True)])


def _generate(target: LoadedModel, jobs: list[tuple[list[int], int]]) -> list[TokenSequence]:
    """Each (prompt ids, new-token budget) answered greedily; prompts the target cannot read are dropped."""
    vocab, room = target.model.config.vocab_size, target.model.config.max_position
    jobs = [(p, budget) for p, budget in jobs if p and max(p) < vocab and len(p) + 1 < room]
    if not jobs:
        return []
    engine = LLMEngine(target.model, EngineConfig(num_slots=min(_SLOTS, len(jobs)), max_len=room),
                       target.tokenizer.eos_token_ids)
    params = [SamplingParams(max_tokens=min(budget, room - len(p)), temperature=0.0) for p, budget in jobs]
    out = engine.generate([p for p, _ in jobs], params)
    return [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in out]

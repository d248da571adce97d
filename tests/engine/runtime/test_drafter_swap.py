"""Drafter swaps in the engine loop: between two steps, running sequences keep their drafter, new ones
get the new drafter, outputs stay token-identical to plain decoding, a refused swap changes nothing."""

import asyncio

import pytest
import torch

from specloop.engine.runtime.llm_engine import DrafterBuild, EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer, ServedDrafter
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.timeout(60)

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [11, 12, 13], [3, 2, 1, 3, 2], [7, 7, 7]]


class SwapOnce(Proposer):
    """Wraps a proposer and, at its `at`-th propose, asks the engine to swap to `then` (from the engine
    thread, as any caller may: the swap takes effect at the next step)."""

    def __init__(self, inner: Proposer, at: int, then: DrafterBuild) -> None:
        self.inner, self.at, self.then, self.calls = inner, at, then, 0
        self.block_size, self.tap_layers = inner.block_size, inner.tap_layers
        self.engine: LLMEngine | None = None
        self.swapped = None
        self.live_seen: set[int] = set()

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.inner.allocate(num_slots, max_len)

    def observe(self, slots, starts, taps, token_ids) -> None:
        self.inner.observe(slots, starts, taps, token_ids)

    def propose(self, slots, ctx_lens, last_tokens, histories) -> torch.Tensor:
        self.calls += 1
        self.live_seen.add(self.engine.stats().drafters_live)
        if self.calls == self.at:
            assert self.engine is not None
            self.swapped = self.engine.swap(self.then)
        return self.inner.propose(slots, ctx_lens, last_tokens, histories)


def plain(target, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), ())
    return [s.output_ids for s in engine.generate(prompts, GREEDY)]


def dflash_build(target, block_size: int, version: str):
    def build(num_slots: int, positions: int) -> ServedDrafter:
        proposer = DFlashProposer(tiny_drafter(target, block_size=block_size, seed=5), target)
        proposer.allocate(num_slots, positions)
        return ServedDrafter(proposer, version)
    return build


def test_a_swap_mid_run_keeps_outputs_and_pins_each_sequence_to_one_drafter() -> None:
    target = tiny_target()
    first = SwapOnce(NgramProposer(block_size=4), at=3, then=dflash_build(target, block_size=6, version="v2"))
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), first, drafter_version="v1")
    first.engine = engine
    seqs = engine.generate(PROMPTS, GREEDY)

    assert [s.output_ids for s in seqs] == plain(target, PROMPTS)
    assert first.swapped.result().version == "v2"
    versions = [s.drafter.version for s in seqs]
    # Two slots: the first two sequences were admitted before the swap, the rest after it.
    assert versions[:2] == ["v1", "v1"] and versions[2:] == ["v2"] * 4
    assert all(s.spec.drafts > 0 for s in seqs)
    assert first.live_seen == {1, 2}  # v1 kept drafting for its sequences after v2 came in
    assert {len(s.spec.accepted_per_position) for s in seqs[2:]} == {5}  # v2 drafts 5 tokens per block
    stats = engine.stats()
    assert (stats.drafter_version, stats.swaps, stats.drafters_live) == ("v2", 1, 1)
    assert stats.last_swap_pause_s > 0


def test_an_idle_old_drafter_is_retired_at_the_swap() -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=3, max_len=96), (), NgramProposer(block_size=4),
                       drafter_version="v1")
    long_params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    old = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0))  # warm path
    assert old[0].drafter.version == "v1"
    done = engine.swap(dflash_build(target, block_size=4, version="v2"))
    assert not done.done()  # nothing happens until a step
    seqs = engine.generate([PROMPTS[1]], long_params)
    assert done.result().version == "v2" and seqs[0].drafter.version == "v2"
    assert engine.stats().drafters_live == 1  # v1 served nothing any more: retired at once


def test_a_refused_build_leaves_the_drafter_serving() -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4),
                       drafter_version="v1")

    def broken(num_slots: int, positions: int) -> ServedDrafter:
        raise ValueError("drafter weights: NaN")

    done = engine.swap(broken)
    seqs = engine.generate(PROMPTS[:2], GREEDY)
    with pytest.raises(ValueError, match="NaN"):
        done.result()
    assert engine.drafter_version == "v1" and engine.stats().swaps == 0
    assert [s.drafter.version for s in seqs] == ["v1", "v1"]
    assert [s.output_ids for s in seqs] == plain(target, PROMPTS[:2])


def test_a_block_past_the_engines_maximum_is_refused() -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96, max_block_size=4), ())

    def too_long(num_slots: int, positions: int) -> ServedDrafter:
        return ServedDrafter(NgramProposer(block_size=8), "v9")

    done = engine.swap(too_long)
    engine.generate([PROMPTS[0]], GREEDY)
    with pytest.raises(ValueError, match="max_block_size 4"):
        done.result()
    assert engine.drafter is None


def test_swapping_to_no_drafter_decodes_new_sequences_plainly() -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4),
                       drafter_version="v1")
    engine.swap(lambda num_slots, positions: None)
    seqs = engine.generate(PROMPTS[:2], GREEDY)
    assert [s.drafter for s in seqs] == [None, None] and all(s.spec.drafts == 0 for s in seqs)
    assert [s.output_ids for s in seqs] == plain(target, PROMPTS[:2])
    assert engine.stats().drafter_version is None and engine.stats().drafters_live == 0


def test_streamed_deltas_name_the_drafter_that_drafted() -> None:
    target = tiny_target()
    engine = LLMEngine(target, EngineConfig(num_slots=2, max_len=96), (), NgramProposer(block_size=4),
                       drafter_version="v1")
    engine.start()
    try:
        async def run() -> list:
            return [d async for d in engine.stream(PROMPTS[0], GREEDY)]

        deltas = asyncio.run(run())
    finally:
        engine.stop()
    assert {d.drafter_version for d in deltas} == {"v1"} and deltas[-1].finished

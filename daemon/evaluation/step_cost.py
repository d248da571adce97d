"""What a verify step costs on this machine, so that a replay can tell decode speed and not only τ.

A step of B sequences verifying w positions each, R of whose drafts DFlash made, costs:

    target pass over [B, w] tokens (KV cache at a typical context, LM head on every position)
  + suffix lookup for each of the B rows (every served proposer looks up first)
  + DFlash, when the proposer has one: for the R rows it drafts, the write of the positions it held
    since it last drafted them, and its propose

and each sequence's prefill, in serving's chunks of `PREFILL_CHUNK` prompt tokens, costs the target's
pass over them; a drafter holds the prompt's positions as it holds every observed one. DFlash writes
what it observed (fusion, context keys and values) only when it next drafts that row, or when a row
holds more than `HELD_POSITIONS` (`engine/speculation/dflash_proposer.py`); `HeldRows` follows that
rule for the replay, so a drafter pays for a prompt and for the steps lookup drafted in its place
once, when it drafts or holds too much (unpriced, the prompt had made the model rate drafter systems
3-5% faster against suffix decoding alone than live decoding did; docs/performance.md, "The bench,
and training only where suffix decoding misses").

Each term is measured here, in the process that replays, on this CPU under its current load: the
passes over positions (the target's, the drafter's observe) as a `PassCost` between measured
widths, since a pass's cost steps with its positions (one line over them priced a one-row step at
twice its cost), and the per-row terms fitted `fixed + per row`. Two contenders whose drafters have
the same shape share one measurement of their drafter: their costs are equal, so only what they
draft differs.
That keeps a machine's load changing between two calibrations out of the gain between them, which
the paired bootstrap over traces (`speed_gain.py`) could not see.

Why a model and not a live run: replaying 400 held-out traces live, per contender, takes about 20
minutes on a 2-core CPU; the replay with the model takes seconds beyond the τ replay.
`benchmarks/suffix_decoding.py` checks the model against live generation.
Not here: the replay (`replay.py`), judging a gain (`speed_gain.py`).
"""

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from specloop.engine.cpu.fused_decode import MAX_ROWS
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.model_runner import ModelRunner
from specloop.engine.runtime.sequence import SamplingParams, Sequence
from specloop.engine.runtime.verify_cost import Linear, PassCost, measure_pass, median_seconds, pass_shapes
from specloop.engine.speculation.build import dflash_of
from specloop.engine.speculation.dflash_proposer import HELD_POSITIONS, DFlashProposer
from specloop.engine.speculation.proposer import Proposer
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer

GRID = pass_shapes(8, 16)  # (batch, width) measured: the replay's groups, the widest draft, a prompt chunk
ROWS = (1, 4, 8)  # propose batch sizes measured
CONTEXT = 256  # cached positions each sequence attends to while measured
PREFILL_CHUNK = 128  # prompt tokens per prefill pass: `specloop serve`'s `max_prefill_tokens`


@dataclass
class HeldRows:
    """How many observed positions DFlash holds unwritten per row, by `DFlashProposer`'s rule: an
    observed part replaces what was held from its start on, and the held rows are written when DFlash
    drafts the row or once they exceed `HELD_POSITIONS`."""

    start: dict[int, int] = field(default_factory=dict)  # row -> first held position
    end: dict[int, int] = field(default_factory=dict)  # row -> one past the last

    def observe(self, row: int, start: int, n: int) -> int:
        """Positions `start .. start+n−1` observed; returns how many the observe writes (0 or all held)."""
        self.start.setdefault(row, start)
        self.end[row] = start + n
        return self.take(row) if self.end[row] - self.start[row] > HELD_POSITIONS else 0

    def take(self, row: int) -> int:
        """The row's held positions, written now."""
        first = self.start.pop(row, None)
        return 0 if first is None else self.end.pop(row) - first


@dataclass(frozen=True)
class StepCost:
    target: PassCost  # over verified positions (B × w)
    lookup: Linear  # per row looked up
    dflash_write: PassCost | None = None  # over the held positions one call writes; None: no drafter
    dflash_propose: Linear | None = None  # per row DFlash drafts
    max_rows: int | None = None  # the most rows a pass may verify and keep plain decoding's numerics

    def exact_drafts(self, batch: int) -> int | None:
        """As the engine caps a step (`engine/runtime/verify_cost.py`, `exact_num_drafts`)."""
        return None if self.max_rows is None else max(0, self.max_rows // batch - 1)

    def seconds(self, batch: int, width: int, learned_rows: int, written: Iterable[int] = ()) -> float:
        """A step; `written`: the held positions of each row DFlash writes in it."""
        s = self.target(batch * width) + self.lookup(batch) + self.write_seconds(written)
        if self.dflash_propose is not None and learned_rows:
            s += self.dflash_propose(learned_rows)
        return s

    def write_seconds(self, written: Iterable[int]) -> float:
        """DFlash's writes of rows holding `written` positions each: one call per count, as it groups them."""
        if self.dflash_write is None:
            return 0.0
        return sum(self.dflash_write(n * rows) for n, rows in Counter(written).items() if n)

    def prefill_seconds(self, prompt: int, held: HeldRows | None = None, row: int = 0) -> float:
        """A prompt of `prompt` tokens prefilled in `PREFILL_CHUNK`s: the target's passes, and the writes of
        the drafter's observes past `HELD_POSITIONS` (`held`: the replay's, with a drafter)."""
        seconds = 0.0
        for start in range(0, prompt, PREFILL_CHUNK):
            chunk = min(PREFILL_CHUNK, prompt - start)
            seconds += self.target(chunk)
            if held is not None:
                seconds += self.write_seconds([held.observe(row, start, chunk)])
        return seconds

    def to_json(self) -> dict[str, float]:
        lines = {"lookup": self.lookup, "dflash_propose": self.dflash_propose}
        passes = {"target": self.target, "dflash_write": self.dflash_write}
        return {**{f"{name}_{k}_ms": v * 1e3 for name, p in lines.items() if p is not None
                   for k, v in (("fixed", p.fixed_s), ("per_unit", p.per_unit_s))},
                **{f"{name}_{n}_ms": v * 1e3 for name, p in passes.items() if p is not None for n, v in p.points}}


class CostModel:
    """Measures the parts of a step once per contest and builds each contender's `StepCost` from them."""

    def __init__(self, target: Transformer, histories: list[list[int]], namespace: str) -> None:
        """`histories`: token sequences like the replayed ones, whose ends the lookup is timed on, in the
        suffix cache's `namespace` (as the replay looks up)."""
        assert histories, "the lookup is timed on real histories"
        self.target, self.histories, self.namespace = target, histories, namespace
        self.context = min(CONTEXT, target.config.max_position // 2)  # tiny test models hold few positions
        self.width = max(w for _, w in GRID)
        self.runner = ModelRunner(target, max(b for b, _ in GRID), self.context + self.width, slack=0)
        self._target = measure_pass(target, list(GRID), self.context)
        self.max_rows = None if target.fused_decoder is None else MAX_ROWS
        self._lookup: dict[SuffixConfig, Linear] = {}
        self._drafters: dict[str, tuple[PassCost, Linear]] = {}

    def cost(self, proposer: Proposer) -> StepCost:
        lookup = self._lookup_cost(proposer)
        dflash = dflash_of(proposer)
        if dflash is None:
            return StepCost(self._target, lookup, max_rows=self.max_rows)
        key = repr(dflash.drafter.config)  # same shape, same cost: measured once
        if key not in self._drafters:
            self._drafters[key] = self._dflash_costs(dflash)
        return StepCost(self._target, lookup, *self._drafters[key], max_rows=self.max_rows)

    @torch.inference_mode()
    def _fit_grid(self, run: Callable[[list[Sequence], torch.Tensor], object]) -> PassCost:
        seconds = {}
        for b, w in GRID:
            seqs = [Sequence([0], SamplingParams(), slot=i, num_cached=self.context) for i in range(b)]
            block = torch.zeros(b, w, dtype=torch.long)
            seconds[(b, w)] = median_seconds(lambda seqs=seqs, block=block: run(seqs, block))
        return PassCost.fit(seconds)

    def _lookup_cost(self, proposer: Proposer) -> Linear:
        lookup = getattr(proposer, "lookup", proposer)
        if not isinstance(lookup, SuffixProposer):
            return Linear(0.0, 0.0)  # n-gram lookup: tiny, and the same for every contender
        if lookup.config not in self._lookup:
            for slot in range(max(ROWS)):
                lookup.begin(slot, self.namespace)
            rows = [self.histories[i % len(self.histories)] for i in range(max(ROWS))]
            last = torch.zeros(max(ROWS), dtype=torch.long)
            seconds = [median_seconds(lambda n=n: lookup.propose(list(range(n)), [0] * n, last[:n], rows[:n]))
                       for n in ROWS]
            self._lookup[lookup.config] = Linear.fit(list(ROWS), seconds)
        return self._lookup[lookup.config]

    @torch.inference_mode()
    def _dflash_costs(self, dflash: DFlashProposer) -> tuple[PassCost, Linear]:
        """(observe and write per position, propose per row) of one drafter."""
        dflash.allocate(max(ROWS), self.context + 2 * self.width)
        _, taps = self.runner.run_block([Sequence([0], SamplingParams(), slot=0, num_cached=self.context)],
                                        torch.zeros(1, self.width, dtype=torch.long), dflash.tap_layers)

        def write(seqs: list[Sequence], block: torch.Tensor) -> None:
            b, w = block.shape
            dflash.observe(list(range(b)), [self.context] * b, [t[:, :w].expand(b, -1, -1) for t in taps], block)
            dflash.write()

        writing = self._fit_grid(write)
        last = torch.zeros(max(ROWS), dtype=torch.long)
        seconds = [median_seconds(lambda n=n: dflash.propose(list(range(n)), [self.context] * n, last[:n], [[0]] * n))
                   for n in ROWS]
        return writing, Linear.fit(list(ROWS), seconds)

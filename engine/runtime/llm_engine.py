"""The engine loop: continuous batching with optional speculative decoding, on one background thread.

Each `step` admits waiting requests into free KV-cache slots, prefills at most one chunk of one
prompt (`max_prefill_tokens`), and advances every decoding sequence by one pass: a plain one-token
decode, or (when a proposer is loaded and the request allows it) a verify pass over `[last token, k
drafts]` that commits between 1 and k+1 tokens per sequence, k chosen per step from the drafts'
estimated acceptance and the pass's measured cost (`engine/runtime/verify_cost.py`). Decoding in
every step, prefill or not,
bounds what new prompts cost the streams already running: with prefill-only steps, 8 clients
restarting together stalled each other's streams for 1.3 s (8 prompts of ~40 tokens, one after
another, on a 2-core Zen 3) and a flood of short requests multiplied such stalls
(benchmarks/abuse.py). New requests join between steps and finished ones leave, so the batch changes
shape every step.

A sequence with a grammar (structured output) has its logits masked before every sample, verify
rows included (`engine/runtime/grammar.py` says why that stays exact); one that asks for
log-probabilities gets them from the same rows, unmasked (`engine/runtime/logprobs.py`).

Callers either `stream()` from asyncio (the HTTP server) or call `generate()` synchronously
(benchmarks, data generation, tests). The engine knows token ids only: no text, no HTTP.

Drafter swaps (`swap`) take effect between two steps. A sequence keeps the drafter it was admitted
with until it finishes, so for a while two drafters serve side by side, each verifying its own
sequences. The other choice, rebuilding the new drafter's context for running sequences, would need
the target's hidden states of every cached position at the new drafter's tap layers, that is a
second target pass over every context; keeping the old drafter costs a second, smaller verify pass
per step until its last sequence ends, and verification is lossless either way. Sequences admitted
before any drafter existed never speculate: no drafter observed their prompt.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.grammar import Grammar, mask_logits
from specloop.engine.runtime.logprobs import token_logprobs
from specloop.engine.runtime.model_runner import ModelRunner
from specloop.engine.runtime.sampler import Sampler
from specloop.engine.runtime.scheduler import PrefillChunk, Scheduler
from specloop.engine.runtime.sequence import SamplingParams, Sequence, Status, TokenDelta
from specloop.engine.runtime.torch_thread import TorchThread
from specloop.engine.runtime.verify_cost import (PassCost, WithStep, best_num_drafts, exact_num_drafts, measure_pass,
                                                 pass_shapes)
from specloop.engine.speculation.proposer import NO_DRAFT, ServedDrafter, draft_lengths
from specloop.engine.speculation.verify import accept_lengths, committed_tokens

if TYPE_CHECKING:
    from specloop.engine.speculation.proposer import Proposer

# Builds the next drafter on the engine thread, between two steps, from the per-slot capacity it
# must allocate: (num_slots, positions per slot). Raising refuses the swap; None swaps to no drafter.
DrafterBuild = Callable[[int, int], "ServedDrafter | None"]

log = logging.getLogger(__name__)
REMEASURE_TRIES, REMEASURE_AFTER_S = 5, 60.0  # a verify cost fitted at no cost per position (`verify_cost`)
UNPAID_STEPS, UNPAID_PROBE = 4, 8  # when a proposer whose drafts are never verified is asked (`_skips_proposing`)
LIKELY = 0.5  # a step's first drafts are likely when their mean estimate is at least this
STEP_WEIGHT = 0.1  # weight of the latest verify step in the running mean of its time outside the pass


@dataclass(frozen=True)
class Listener:
    """Where a streamed request's deltas go: a queue owned by an asyncio event loop."""

    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue


def _put_all(items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    for deltas, delta in items:
        deltas.put_nowait(delta)


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8  # max concurrent sequences (KV-cache capacity); more requests wait
    max_len: int = 2048  # context length: prompt + completion tokens per sequence
    max_prefill_tokens: int = 2048
    speculate: bool = True  # server-wide switch; only matters when a proposer is loaded
    # The longest verify block any drafter may bring, now or after a swap: the KV cache holds this many
    # positions past max_len for a verify pass's dead rows (16 per slot: 0.8% of a 2048 context).
    max_block_size: int = 16
    queue_timeout_s: float | None = None  # a sequence still waiting for a slot this long ends with "timeout"

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.max_block_size < 2:
            raise ValueError(f"max_block_size must be >= 2, got {self.max_block_size}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")


class PromptTooLong(ValueError):
    """The prompt leaves no room for a single completion token within the context length."""


@dataclass(frozen=True)
class EngineStats:
    waiting: int = 0
    running: int = 0
    slots_used: int = 0
    slots_total: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    steps: int = 0
    drafter_version: str | None = None  # the drafter new sequences get
    drafters_live: int = 0  # drafters serving sequences: 2 for a while after a swap
    swaps: int = 0
    last_swap_pause_s: float = 0.0  # the engine thread's time spent in the last swap, build included


class LLMEngine:
    def __init__(self, model: Transformer, config: EngineConfig, eos_token_ids: Seq[int],
                 proposer: Proposer | None = None, thread: TorchThread | None = None,
                 drafter_version: str | None = None, verify_cost: PassCost | None = None) -> None:
        """`thread` runs the loop after `start()`: pass the one that built the model and this engine
        (see `engine/runtime/torch_thread.py`); without it, `start()` makes a new one.
        `drafter_version` names `proposer`'s drafter (see `ServedDrafter`). `verify_cost`: a pass cost
        measured before, kept instead of measuring one (benchmarks comparing proposers share one: each
        engine's own measurement moved by up to 30% on a shared VM, and the widths it picks with it)."""
        if config.max_len > model.rope_cos.shape[0]:
            raise ValueError(f"max_len {config.max_len} exceeds the model's {model.rope_cos.shape[0]} positions")
        self.model = model
        self.config = config
        self.eos = frozenset(eos_token_ids)
        self.runner = ModelRunner(model, config.num_slots, config.max_len, config.max_block_size)
        self._verify_cost: PassCost | None = verify_cost
        self._verify_cost_at = 0.0  # time.monotonic() of the last measurement
        self._verify_cost_tries = 0 if verify_cost is None else REMEASURE_TRIES  # one given is kept
        self.drafter: ServedDrafter | None = None  # what new sequences get
        self._drafters: list[ServedDrafter] = []  # every drafter serving a sequence, and the current one
        # proposer -> {batch size: likely steps since a draft paid}; a swapped-out proposer's goes with it
        self._unpaid: weakref.WeakKeyDictionary[Proposer, dict[int, int]] = weakref.WeakKeyDictionary()
        self._step_s = 0.0  # running mean of a verify step's seconds outside the target's pass
        if proposer:
            self._serve(ServedDrafter(self._allocated(proposer), drafter_version))
            _ = self.verify_cost  # measured now, not during the first request
        self._swaps: queue.SimpleQueue = queue.SimpleQueue()
        self._swap_count, self._swap_pause_s = 0, 0.0
        self.scheduler = Scheduler(config.num_slots, config.max_prefill_tokens)
        self.sampler = Sampler(model.device)
        self._listeners: dict[int, Listener] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = thread
        self._loop_done: Future | None = None
        self._steps = 0
        self._stats = EngineStats(slots_total=config.num_slots, kv_tokens_total=config.num_slots * config.max_len,
                                  drafter_version=self.drafter_version, drafters_live=len(self._drafters))

    # ----- public API -------------------------------------------------------------------------

    def start(self) -> None:
        assert self._loop_done is None, "engine already started"
        self._thread = self._thread or TorchThread()
        self._loop_done = self._thread.submit(self._loop)

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._loop_done is not None:
            wait([self._loop_done], timeout=30)
            self._loop_done = None
        while True:  # swaps asked for but never applied: their callers must not wait forever
            try:
                _, done = self._swaps.get_nowait()
            except queue.Empty:
                break
            if done.set_running_or_notify_cancel():
                done.set_exception(RuntimeError("engine stopped before the swap"))

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def proposer(self) -> Proposer | None:
        """The proposer new sequences draft with."""
        return self.drafter.proposer if self.drafter else None

    @property
    def drafter_version(self) -> str | None:
        return self.drafter.version if self.drafter else None

    def swap(self, build: DrafterBuild) -> Future:
        """Serve the drafter `build(num_slots, positions)` returns, from the next step on; thread-safe.

        `build` runs on the engine thread between two steps, so it may use the target model; the
        future holds the new `ServedDrafter` (or None), or the exception that refused it, in which case
        the drafter serving now keeps serving. Sequences already running finish with their drafter.
        """
        done: Future = Future()
        self._swaps.put((build, done))
        self._commands.put(("wake",))
        return done

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.config.max_len:
            raise PromptTooLong(f"prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_len} "
                                f"including at least one completion token")
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model.config.vocab_size}): {bad[:5]}")

    async def stream(self, prompt_ids: list[int], params: SamplingParams, grammar: Grammar | None = None,
                     tenant: str = "", suffix_cache: bool = True) -> AsyncIterator[TokenDelta]:
        """Yield this request's deltas; leaving the iterator early aborts it and frees its slot.
        With a `grammar`, every token is sampled from the distribution it allows; `tenant` is whose
        request it is, for the scheduler's fair share and suffix decoding's cache, which the request
        reads and adds to only with `suffix_cache`."""
        assert self.alive, "engine not started"
        self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()
        seq = Sequence(list(prompt_ids), params, grammar=grammar, tenant=tenant, suffix_cache=suffix_cache)
        self._commands.put(("add", seq, Listener(loop, deltas)))
        finished = False
        try:
            while not finished:
                delta = await deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self._commands.put(("abort", seq))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 grammars: list[Grammar | None] | None = None) -> list[Sequence]:
        """Run prompts to completion on the calling thread (the engine thread must not be running)."""
        assert self._loop_done is None, "generate() runs the loop itself; do not start() the engine"
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for prompt, p, g in zip(prompts, params_list, grammars or [None] * len(prompts), strict=True):
            self.check_prompt(prompt)
            seqs.append(Sequence(list(prompt), p, grammar=g))
            self._add(seqs[-1], None)
        while self.scheduler.has_work:
            self.step()
        return seqs

    # ----- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.scheduler.has_work)
            self._apply_swaps()
            if not self.scheduler.has_work:
                continue
            try:
                results = self.step()
            except Exception:
                log.exception("engine step failed; aborting %d sequences", len(self.scheduler.running))
                results = self._fail_all()
            self._deliver(results)

    def _deliver(self, results: list[tuple[Sequence, TokenDelta]]) -> None:
        """Hand a step's deltas to their listeners: one wake-up per event loop, not one per sequence
        (the loop's Python work competes with the engine for the cores and the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
        for seq, delta in results:
            listener = self._listeners.get(seq.seq_id)
            if listener is not None:
                batches.setdefault(listener.loop, []).append((listener.deltas, delta))
            if delta.finished:
                self._listeners.pop(seq.seq_id, None)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            while True:
                self._apply(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._add(cmd[1], cmd[2])
        elif cmd[0] == "abort" and cmd[1].status is not Status.FINISHED:
            self._finish(cmd[1], "abort")
            self._listeners.pop(cmd[1].seq_id, None)
            self._publish_stats()

    def _add(self, seq: Sequence, listener: Listener | None) -> None:
        if listener is not None:
            self._listeners[seq.seq_id] = listener
            if self.config.queue_timeout_s is not None:  # streamed requests wait for a client; generate() never
                seq.deadline = time.monotonic() + self.config.queue_timeout_s
        self.sampler.register(seq.seq_id, seq.params)
        self.scheduler.add(seq)

    def step(self) -> list[tuple[Sequence, TokenDelta]]:
        """One engine step; returns the deltas it produced."""
        self._apply_swaps()
        expired = self.scheduler.expire(time.monotonic())
        for seq in expired:
            self._finish(seq, "timeout")
        self.scheduler.admit()
        seqs = self.scheduler.decoding()  # before prefill: a prompt finishing now samples its first token there
        chunk = self.scheduler.prefill_chunk()
        results = self._prefill(chunk) if chunk else []
        plain = [s for s in seqs if not self._speculates(s)]
        results += [r for d in self._drafters for r in self._verify([s for s in seqs if s.drafter is d
                                                                    and self._speculates(s)], d.proposer)]
        results += self._decode(plain) if plain else []
        self._steps += 1
        self._retire_idle_drafters()
        self._publish_stats()
        return [(s, self._delta(s, [], "timeout")) for s in expired] + results

    @property
    def verify_cost(self) -> PassCost:
        """This machine's target pass time over a number of positions, measured on a cache of its own:
        once, or again (a minute apart, `REMEASURE_TRIES` times at most) while it says positions cost
        nothing. The widest pass never costs less than the narrowest, so that means the measurement ran
        beside another busy process: `specloop up` with no drafter for its model starts the daemon's first
        drafter run as the engine measures (NVFP4, 2 cores: 779 ms + 0 per position). With it every
        draft would be verified, however unlikely."""
        due = self._verify_cost is None or (
            self._verify_cost.free_positions and self._verify_cost_tries < REMEASURE_TRIES
            and time.monotonic() - self._verify_cost_at >= REMEASURE_AFTER_S)
        if due:
            B, W = self.config.num_slots, self.config.max_block_size
            self._verify_cost = measure_pass(self.model, pass_shapes(B, W))
            self._verify_cost_at, self._verify_cost_tries = time.monotonic(), self._verify_cost_tries + 1
            log.info("verify pass (positions: ms): %s", ", ".join(f"{n}: {s * 1e3:.1f}"
                                                                 for n, s in self._verify_cost.points))
        return self._verify_cost

    def _speculates(self, seq: Sequence) -> bool:
        return seq.drafter is not None and self.config.speculate and seq.params.speculate

    # ----- drafters ---------------------------------------------------------------------------

    def _allocated(self, proposer: Proposer) -> Proposer:
        self._check_block_size(proposer)
        proposer.allocate(self.config.num_slots, self.config.max_len + self.config.max_block_size)
        return proposer

    def _serve(self, drafter: ServedDrafter | None) -> None:
        self.drafter = drafter
        if drafter is not None:
            self._drafters.append(drafter)

    def _apply_swaps(self) -> None:
        while not self._swaps.empty():  # checked every step: no exception raised on the common path
            build, done = self._swaps.get_nowait()  # only the loop takes from it (stop(), once it has ended)
            if not done.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                drafter = build(self.config.num_slots, self.config.max_len + self.config.max_block_size)
                if drafter is not None:
                    self._check_block_size(drafter.proposer)
            except Exception as exc:  # the build's own refusal: the drafter serving now keeps serving
                done.set_exception(exc)
                continue
            old = self.drafter_version
            self._serve(drafter)
            self._swap_count += 1
            self._swap_pause_s = time.perf_counter() - started
            self._retire_idle_drafters()
            self._publish_stats()
            log.info("drafter %s -> %s for new sequences (%.1f ms on the engine thread; %d drafters serving)",
                     old, self.drafter_version, self._swap_pause_s * 1e3, len(self._drafters))
            done.set_result(drafter)

    def _check_block_size(self, proposer: Proposer) -> None:
        if proposer.block_size > self.config.max_block_size:
            raise ValueError(f"block_size {proposer.block_size} exceeds the engine's max_block_size "
                             f"{self.config.max_block_size}")

    def _retire_idle_drafters(self) -> None:
        """Drop drafters that are not current and serve no running sequence (their memory goes too)."""
        live = {id(s.drafter) for s in self.scheduler.running}
        self._drafters = [d for d in self._drafters if d is self.drafter or id(d) in live]

    def _taps(self, seq: Sequence) -> tuple[int, ...]:
        return seq.drafter.proposer.tap_layers if seq.drafter else ()

    def _prefill(self, chunk: PrefillChunk) -> list[tuple[Sequence, TokenDelta]]:
        seq = chunk.seq
        if chunk.start == 0:
            seq.drafter = self.drafter  # kept for the sequence's life: only it observes this context
            if seq.drafter:
                seq.drafter.proposer.begin(seq.slot, seq.tenant if seq.suffix_cache else None)
        scoring = seq.params.prompt_logprobs is not None
        logits, taps = self.runner.prefill(seq, chunk.start, chunk.end, self._taps(seq), every_position=scoring)
        if seq.drafter:
            tokens = torch.tensor([seq.prompt_ids[chunk.start:chunk.end]], device=self.model.device)
            seq.drafter.proposer.observe([seq.slot], [chunk.start], taps, tokens)
        seq.num_cached = chunk.end
        if scoring:
            self._score_prompt(seq, chunk, logits)
            logits = logits[-1]
        if not chunk.is_last:
            return []
        if seq.params.max_tokens == 0:  # scoring only (echo with max_tokens 0)
            self._finish(seq, "length")
            return [(seq, self._delta(seq, [], "length"))]
        raw = self._constrain(seq, logits.view(1, -1), [])  # [1, V]
        token = self.sampler.sample(logits.view(1, 1, -1), [seq.seq_id], [seq.params])
        return [self._commit(seq, [int(token[0, 0])], raw)]

    @staticmethod
    def _score_prompt(seq: Sequence, chunk: PrefillChunk, logits: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this chunk's logits `[n, V]` predict: position p's
        logits predict token p + 1, so a chunk scores the tokens after it (the first has none)."""
        if chunk.start == 0:
            seq.prompt_logprobs.append(None)
        targets = seq.prompt_ids[chunk.start + 1:chunk.end + 1]
        seq.prompt_logprobs.extend(token_logprobs(logits[:len(targets)], targets, seq.params.prompt_logprobs))

    def _decode(self, seqs: list[Sequence], observer: Proposer | None = None) -> list[tuple[Sequence, TokenDelta]]:
        """One plain step; `observer` (a proposer skipped this step) observes its pass as after a verify."""
        block = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long, device=self.model.device)  # [B, 1]
        taps = observer.tap_layers if observer is not None else ()
        logits, tapped = self.runner.run_block(seqs, block, taps)
        if observer is not None:
            observer.observe([s.slot for s in seqs], [s.num_cached for s in seqs], tapped, block)
        raw = [self._constrain(seq, logits[b], []) for b, seq in enumerate(seqs)]  # each [1, V]
        tokens = self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])  # [B, 1]
        results = []
        for b, (seq, token) in enumerate(zip(seqs, tokens[:, 0].tolist())):
            seq.num_cached += 1
            results.append(self._commit(seq, [token], raw[b]))
        return results

    def _verify(self, seqs: list[Sequence], proposer: Proposer) -> list[tuple[Sequence, TokenDelta]]:
        if not seqs:
            return []
        if self._skips_proposing(seqs, proposer):
            self._count_unpaid(proposer, len(seqs), paid=False)
            return self._decode(seqs, proposer)
        cost = self.verify_cost  # first, so that a measurement it makes is not counted as the step's
        started = time.perf_counter()
        slots, starts = [s.slot for s in seqs], [s.num_cached for s in seqs]
        last = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=self.model.device)  # [B]
        drafts = proposer.propose(slots, starts, last, [s.tokens for s in seqs]).to(last.device)  # [B, k]
        assert drafts.shape == (len(seqs), proposer.num_drafts)
        lengths = draft_lengths(drafts)  # [B]
        # Only as wide as pays (a batch of rows without drafts is a plain decode pass), and as wide as the
        # numerics of plain decoding allow: verify_cost.py.
        limit = exact_num_drafts(self.model, len(seqs))
        confidence = proposer.last_confidence
        if confidence is None:  # every draft certain
            confidence = torch.ones(drafts.shape)
        if any(s.params.verify_all_drafts for s in seqs):
            confidence = torch.ones(drafts.shape)
        keep = best_num_drafts(confidence, lengths, WithStep(cost, self._step_s), limit)
        drafted = (lengths > 0).cpu()  # [B]; the estimates are on the CPU
        if keep > 0 or (bool(drafted.any()) and float(confidence[drafted, 0].mean()) >= LIKELY):
            # Counted unpaid only where the pass's price, not the drafts, kept them out: likely drafts
            # (every one of 8 rows' at 0.8 stays out of a `gguf` pass at concurrency 8), not unlikely ones.
            self._count_unpaid(proposer, len(seqs), paid=keep > 0)
        drafts = drafts[:, :keep]  # [B, k'], NO_DRAFT past each row's length, never accepted
        lengths = lengths.clamp(max=keep).tolist()
        block = torch.cat([last.unsqueeze(1), torch.where(drafts == NO_DRAFT, last.unsqueeze(1), drafts)], dim=1)
        logits, taps = self.runner.run_block(seqs, block, proposer.tap_layers)  # [B, k'+1, V]
        proposer.observe(slots, starts, taps, block)
        raw = [self._constrain(seq, logits[b], drafts[b, :lengths[b]].tolist())  # each [k'+1, V]
               for b, seq in enumerate(seqs)]
        target = self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])  # [B, k'+1]
        allowed = torch.tensor([min(n, self._room(s) - 1) for n, s in zip(lengths, seqs, strict=True)],
                               device=target.device)
        accepted = accept_lengths(drafts, target, allowed)
        proposer.verified(allowed.tolist(), accepted.tolist())
        results = []
        for b, (seq, tokens, n, cap) in enumerate(zip(seqs, committed_tokens(drafts, target, accepted),
                                                      accepted.tolist(), allowed.tolist())):
            seq.num_cached += n + 1
            result = self._commit(seq, tokens, raw[b])  # row i: the target's distribution for token i
            if cap > 0:
                # Drafts the target also predicted past an end-of-sequence or stop token are never
                # committed, so they are not counted: τ is committed tokens per verify step, as replay
                # counts it. They had been: 3 of 16 formal-logic answers (shipped drafter + n-gram,
                # whose lookup drafts the chat template that follows the end) counted 2 such drafts each.
                seq.spec.record(cap, min(n, len(result[1].token_ids) - 1))
            results.append(result)
        # What the step took beyond its pass, which the width rule prices every width with: 0.7-7.7 ms on
        # the Zen 3 with suffix decoding on `gguf`, beside an 18 ms pass of 8 rows (benchmarks/suffix_width.py).
        outside = time.perf_counter() - started - float(cost(len(seqs) * (keep + 1)))
        self._step_s += STEP_WEIGHT * (max(0.0, outside) - self._step_s)
        return results

    def _skips_proposing(self, seqs: list[Sequence], proposer: Proposer) -> bool:
        """Whether this step decodes without asking `proposer`: once `UNPAID_STEPS` steps of this batch
        size with likely drafts have gone unverified since a draft last paid, it is asked only every
        `UNPAID_PROBE`th step until a draft pays again. Suffix decoding's drafts took 2 ms of each 18 ms
        step of 8 `gguf` rows on the Zen 3, where none paid for its place (docs/performance.md). A
        skipped step still taps and shows the proposer its pass (`_decode`), so DFlash's context misses
        no position. Never for a canary's probes (they verify every draft)."""
        if any(s.params.verify_all_drafts for s in seqs):
            return False
        unpaid = self._unpaid.get(proposer, {}).get(len(seqs), 0)
        return unpaid >= UNPAID_STEPS and unpaid % UNPAID_PROBE != 0

    def _count_unpaid(self, proposer: Proposer, batch: int, paid: bool) -> None:
        """A step of `batch` rows proposed (or skipped) whose drafts `paid` for a wider pass, or not."""
        counts = self._unpaid.setdefault(proposer, {})
        counts[batch] = 0 if paid else counts.get(batch, 0) + 1

    @staticmethod
    def _constrain(seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Mask a sequence's logits `[n, V]` in place by its grammar (rows 0..m, m the drafts it allows;
        later rows never commit: `engine/runtime/grammar.py`), and return the unmasked logits its
        log-probabilities are reported from (the tensor itself when nothing is masked or reported)."""
        if seq.grammar is None:
            return logits
        raw = logits.clone() if seq.params.logprobs is not None else logits
        allowed = seq.grammar.masks(drafts)  # [m + 1, V]
        mask_logits(logits[:allowed.shape[0]], allowed)
        return raw

    def _room(self, seq: Sequence) -> int:
        """How many more tokens this sequence may commit (max_tokens and the context both bound it)."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.config.max_len - seq.num_tokens)

    def _commit(self, seq: Sequence, tokens: list[int], logits: torch.Tensor) -> tuple[Sequence, TokenDelta]:
        """Append `tokens` until one ends the sequence; `logits` `[>= len(tokens), V]`: the target's at
        the position that produced each (for log-probabilities)."""
        new, reason = [], None
        for token in tokens:
            seq.output_ids.append(token)
            new.append(token)
            if token in seq.params.stop_token_ids or (token in self.eos and not seq.params.ignore_eos):
                reason = "stop"
            elif self._room(seq) <= 0:
                reason = "length"
            if reason:
                break
        if seq.grammar is not None:
            seq.grammar.accept(new)
            reason = reason or ("stop" if seq.grammar.finished else None)
        if reason:
            self._finish(seq, reason)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = token_logprobs(logits[:len(new)], new, seq.params.logprobs)
            seq.logprobs.extend(logprobs)
        return seq, self._delta(seq, new, reason, logprobs)

    @staticmethod
    def _delta(seq: Sequence, tokens: list[int], reason: str | None, logprobs: list | None = None) -> TokenDelta:
        first = len(seq.output_ids) == len(tokens)  # the sequence's first delta (prefill's)
        prompt_logprobs = seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None
        return TokenDelta(tokens, reason, len(seq.prompt_ids), len(seq.output_ids), seq.spec,
                          seq.drafter.version if seq.drafter else None, logprobs, prompt_logprobs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        was_running = seq.status is Status.RUNNING
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)
        if was_running and seq.drafter:
            seq.drafter.proposer.release(seq.slot, seq.tokens)

    def _fail_all(self) -> list[tuple[Sequence, TokenDelta]]:
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in failed:
            self._finish(seq, "error")
        return [(s, self._delta(s, [], "error")) for s in failed]

    def _publish_stats(self) -> None:
        running = self.scheduler.running
        self._stats = EngineStats(
            waiting=self.scheduler.num_waiting,
            running=len(running),
            slots_used=self.config.num_slots - len(self.scheduler.free_slots),
            slots_total=self.config.num_slots,
            kv_tokens_used=sum(s.num_cached for s in running),
            kv_tokens_total=self.config.num_slots * self.config.max_len,
            steps=self._steps,
            drafter_version=self.drafter_version,
            drafters_live=len(self._drafters),
            swaps=self._swap_count,
            last_swap_pause_s=self._swap_pause_s,
        )

"""The engine loop: continuous batching with optional speculative decoding, on one background thread.

Each `step` admits waiting requests into free KV-cache slots, prefills one chunk budget, or else
advances every decoding sequence by one pass: a plain one-token decode, or (when a proposer is
loaded and the request allows it) a verify pass over `[last token, k drafts]` that commits between
1 and k+1 tokens per sequence. New requests join between steps and finished ones leave, so the
batch changes shape every step.

Callers either `stream()` from asyncio (the HTTP server) or call `generate()` synchronously
(benchmarks, data generation, tests). The engine knows token ids only: no text, no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.model.transformer import Transformer
from engine.runtime.model_runner import ModelRunner
from engine.runtime.sampler import Sampler
from engine.runtime.scheduler import PrefillChunk, Scheduler
from engine.runtime.sequence import SamplingParams, Sequence, Status, TokenDelta
from engine.runtime.torch_thread import TorchThread
from engine.speculation.verify import accept_lengths, committed_tokens

if TYPE_CHECKING:
    from engine.speculation.proposer import Proposer

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")


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


class LLMEngine:
    def __init__(self, model: Transformer, config: EngineConfig, eos_token_ids: Seq[int],
                 proposer: Proposer | None = None, thread: TorchThread | None = None) -> None:
        """`thread` runs the loop after `start()`: pass the one that built the model and this engine
        (see `engine/runtime/torch_thread.py`); without it, `start()` makes a new one."""
        if config.max_len > model.rope_cos.shape[0]:
            raise ValueError(f"max_len {config.max_len} exceeds the model's {model.rope_cos.shape[0]} positions")
        self.model = model
        self.config = config
        self.eos = frozenset(eos_token_ids)
        self.proposer = proposer
        slack = proposer.block_size if proposer else 1
        self.runner = ModelRunner(model, config.num_slots, config.max_len, slack)
        if proposer:
            proposer.allocate(config.num_slots, config.max_len + slack)
        self.scheduler = Scheduler(config.num_slots, config.max_prefill_tokens)
        self.sampler = Sampler(model.device)
        self._listeners: dict[int, Listener] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = thread
        self._loop_done: Future | None = None
        self._steps = 0
        self._stats = EngineStats(slots_total=config.num_slots, kv_tokens_total=config.num_slots * config.max_len)

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

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done()

    def stats(self) -> EngineStats:
        return self._stats

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.config.max_len:
            raise PromptTooLong(f"prompt has {len(prompt_ids)} tokens; the context holds {self.config.max_len} "
                                f"including at least one completion token")
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model.config.vocab_size}): {bad[:5]}")

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Yield this request's deltas; leaving the iterator early aborts it and frees its slot."""
        assert self.alive, "engine not started"
        self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[TokenDelta] = asyncio.Queue()
        seq = Sequence(list(prompt_ids), params)
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

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion on the calling thread (the engine thread must not be running)."""
        assert self._loop_done is None, "generate() runs the loop itself; do not start() the engine"
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for prompt, p in zip(prompts, params_list, strict=True):
            self.check_prompt(prompt)
            seqs.append(Sequence(list(prompt), p))
            self._add(seqs[-1], None)
        while self.scheduler.has_work:
            self.step()
        return seqs

    # ----- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.scheduler.has_work)
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
        self.sampler.register(seq.seq_id, seq.params)
        self.scheduler.add(seq)

    def step(self) -> list[tuple[Sequence, TokenDelta]]:
        """One engine step; returns the deltas it produced."""
        self.scheduler.admit()
        chunks = self.scheduler.prefill_chunks()
        if chunks:
            results = [r for c in chunks for r in self._prefill(c)]
        else:
            seqs = self.scheduler.decoding()
            spec = [s for s in seqs if self._speculates(s)]
            plain = [s for s in seqs if not self._speculates(s)]
            results = (self._verify(spec) if spec else []) + (self._decode(plain) if plain else [])
        self._steps += 1
        self._publish_stats()
        return results

    def _speculates(self, seq: Sequence) -> bool:
        return self.proposer is not None and self.config.speculate and seq.params.speculate

    def _taps(self) -> tuple[int, ...]:
        return self.proposer.tap_layers if self.proposer else ()

    def _prefill(self, chunk: PrefillChunk) -> list[tuple[Sequence, TokenDelta]]:
        seq = chunk.seq
        logits, taps = self.runner.prefill(seq, chunk.start, chunk.end, self._taps())
        if self.proposer:
            tokens = torch.tensor([seq.prompt_ids[chunk.start:chunk.end]], device=self.model.device)
            self.proposer.observe([seq.slot], [chunk.start], taps, tokens)
        seq.num_cached = chunk.end
        if not chunk.is_last:
            return []
        token = self.sampler.sample(logits.view(1, 1, -1), [seq.seq_id], [seq.params])
        return [self._commit(seq, [int(token[0, 0])])]

    def _decode(self, seqs: list[Sequence]) -> list[tuple[Sequence, TokenDelta]]:
        block = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long)  # [B, 1]
        logits, _ = self.runner.run_block(seqs, block, ())
        tokens = self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])  # [B, 1]
        results = []
        for seq, token in zip(seqs, tokens[:, 0].tolist()):
            seq.num_cached += 1
            results.append(self._commit(seq, [token]))
        return results

    def _verify(self, seqs: list[Sequence]) -> list[tuple[Sequence, TokenDelta]]:
        assert self.proposer is not None
        k = self.proposer.block_size - 1
        slots, starts = [s.slot for s in seqs], [s.num_cached for s in seqs]
        last = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=self.model.device)  # [B]
        drafts = self.proposer.propose(slots, starts, last, [s.tokens for s in seqs]).to(last.device)  # [B, k]
        assert drafts.shape == (len(seqs), k)
        block = torch.cat([last.unsqueeze(1), drafts], dim=1)  # [B, k+1]
        logits, taps = self.runner.run_block(seqs, block, self.proposer.tap_layers)
        self.proposer.observe(slots, starts, taps, block)
        target = self.sampler.sample(logits, [s.seq_id for s in seqs], [s.params for s in seqs])  # [B, k+1]
        allowed = torch.tensor([min(k, self._room(s) - 1) for s in seqs], device=target.device)
        accepted = accept_lengths(drafts, target, allowed)
        results = []
        for seq, tokens, n, cap in zip(seqs, committed_tokens(drafts, target, accepted), accepted.tolist(),
                                        allowed.tolist()):
            seq.num_cached += n + 1
            if cap > 0:
                seq.spec.record(cap, n)
            results.append(self._commit(seq, tokens))
        return results

    def _room(self, seq: Sequence) -> int:
        """How many more tokens this sequence may commit (max_tokens and the context both bound it)."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.config.max_len - seq.num_tokens)

    def _commit(self, seq: Sequence, tokens: list[int]) -> tuple[Sequence, TokenDelta]:
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
        if reason:
            self._finish(seq, reason)
        return seq, TokenDelta(new, reason, len(seq.prompt_ids), len(seq.output_ids), seq.spec)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        was_running = seq.status is Status.RUNNING
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)
        if was_running and self.proposer:
            self.proposer.release(seq.slot)

    def _fail_all(self) -> list[tuple[Sequence, TokenDelta]]:
        failed = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in failed:
            self._finish(seq, "error")
        return [(s, TokenDelta([], "error", len(s.prompt_ids), len(s.output_ids), s.spec)) for s in failed]

    def _publish_stats(self) -> None:
        running = self.scheduler.running
        self._stats = EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(running),
            slots_used=self.config.num_slots - len(self.scheduler.free_slots),
            slots_total=self.config.num_slots,
            kv_tokens_used=sum(s.num_cached for s in running),
            kv_tokens_total=self.config.num_slots * self.config.max_len,
            steps=self._steps,
        )

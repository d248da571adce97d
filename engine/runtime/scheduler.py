"""Admission and batching: which sequences run in the next engine step.

Requests wait in FIFO order until a KV-cache slot is free (admission control); admitted sequences
are prefilled in chunks of at most `max_prefill_tokens` per step, and every sequence whose prompt is
fully cached decodes together. Prefill goes first so a new request's first token is not held behind
a long decode run; chunking bounds how long one long prompt can stall the decoders.

The scheduler never touches tensors; it only moves `Sequence`s between lists and hands out slots.
"""

from collections import deque
from dataclasses import dataclass

from specloop.engine.runtime.sequence import Sequence, Status


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first prompt position of this chunk (== seq.num_cached)
    end: int  # one past the last position; the chunk that reaches len(prompt) samples the first token

    @property
    def is_last(self) -> bool:
        return self.end == len(self.seq.prompt_ids)


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be > 0, got {max_prefill_tokens}")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots))
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots; the lowest slot first keeps batches consecutive."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            self.free_slots.sort()
            seq.slot = self.free_slots.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_chunks(self) -> list[PrefillChunk]:
        """Pieces of prompts still to cache this step, within the token budget (at least one chunk)."""
        chunks, budget = [], self.max_prefill_tokens
        for seq in self.running:
            remaining = len(seq.prompt_ids) - seq.num_cached
            if remaining <= 0 or seq.output_ids:
                continue
            take = min(remaining, budget)
            if take <= 0:
                break
            chunks.append(PrefillChunk(seq, seq.num_cached, seq.num_cached + take))
            budget -= take
        return chunks

    def decoding(self) -> list[Sequence]:
        """Running sequences whose whole prompt is cached, ordered by slot."""
        return sorted((s for s in self.running if s.output_ids), key=lambda s: s.slot)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its slot."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

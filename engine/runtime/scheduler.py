"""Admission and batching: which sequences run in the next engine step.

Requests wait until a KV-cache slot is free (admission control), each tenant's in its own FIFO
queue. A free slot goes to the waiting tenant with the fewest sequences running, the one whose
request came first on a tie: a tenant that floods the queue gets its share of the slots, not all of
them, and one with a single request waits for one slot to free, not for the flood to drain.
Sequences still waiting at their deadline leave the queue (`expire`). Admitted sequences are
prefilled in chunks of at most `max_prefill_tokens` per step, and every sequence whose prompt is
fully cached decodes together, in the same step: chunking bounds how long one long prompt can stall
the decoders, and decoding every step means a new prompt's first token is not held behind a long
decode run, nor a running stream behind a queue of prompts.

The scheduler never touches tensors; it only moves `Sequence`s between lists and hands out slots.
How many may wait, and each tenant's own limits, are the server's (`engine/server/admission.py`).
"""

from collections import Counter, deque
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
        self._queues: dict[str, deque[Sequence]] = {}  # by tenant, each in arrival order
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots))
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting sequence, in arrival order."""
        return sorted((s for q in self._queues.values() for s in q), key=lambda s: s.seq_id)

    def add(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.tenant, deque()).append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, fairly between tenants; the lowest slot first keeps
        batches consecutive."""
        admitted = []
        running = Counter(s.tenant for s in self.running)
        while self._queues and self.free_slots:
            tenant = min(self._queues, key=lambda t: (running[t], self._queues[t][0].seq_id))
            seq = self._take(tenant)
            self.free_slots.sort()
            seq.slot = self.free_slots.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            running[tenant] += 1
            admitted.append(seq)
        return admitted

    def expire(self, now: float) -> list[Sequence]:
        """Waiting sequences whose deadline is past, taken out of the queue (the caller finishes them)."""
        expired = [s for q in self._queues.values() for s in q if s.deadline is not None and s.deadline <= now]
        for seq in expired:
            self._remove_waiting(seq)
        return expired

    def _take(self, tenant: str) -> Sequence:
        queue = self._queues[tenant]
        seq = queue.popleft()
        if not queue:
            del self._queues[tenant]
        return seq

    def _remove_waiting(self, seq: Sequence) -> None:
        queue = self._queues[seq.tenant]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant]

    def prefill_chunk(self) -> PrefillChunk | None:
        """The piece of a prompt to cache this step: of the first admitted sequence still prefilling, at
        most the token budget. One sequence a step: each chunk is a forward pass of its own that the
        decoding streams wait for, so two short prompts in one step stall them twice as long."""
        for seq in self.running:
            remaining = len(seq.prompt_ids) - seq.num_cached
            if remaining > 0 and not seq.output_ids:
                return PrefillChunk(seq, seq.num_cached, seq.num_cached + min(remaining, self.max_prefill_tokens))
        return None

    def decoding(self) -> list[Sequence]:
        """Running sequences whose whole prompt is cached, ordered by slot."""
        return sorted((s for s in self.running if s.output_ids), key=lambda s: s.slot)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its slot."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        elif seq in self._queues.get(seq.tenant, ()):
            self._remove_waiting(seq)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def has_work(self) -> bool:
        return bool(self._queues or self.running)

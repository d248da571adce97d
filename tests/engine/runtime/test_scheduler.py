"""The scheduler alone: FIFO admission into the lowest free slots, fair between tenants, waiting
sequences leaving at their deadline, one prompt's chunk a step within the token budget, which
sequences decode, and finishing (slots freed once, waiting requests dropped)."""

import pytest

from specloop.engine.runtime.scheduler import PrefillChunk, Scheduler
from specloop.engine.runtime.sequence import SamplingParams, Sequence, Status

pytestmark = pytest.mark.timeout(30)

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def seq(prompt_len: int, tenant: str = "", deadline: float | None = None) -> Sequence:
    return Sequence(list(range(1, prompt_len + 1)), PARAMS, tenant=tenant, deadline=deadline)


def spans(chunks: list[PrefillChunk]) -> list[tuple[Sequence, int, int, bool]]:
    return [(c.seq, c.start, c.end, c.is_last) for c in chunks]


def run_prefill(chunks: list[PrefillChunk]) -> None:
    """What the engine does with a step's chunks: cache them, and sample a first token after the last."""
    for c in chunks:
        c.seq.num_cached = c.end
        if c.is_last:
            c.seq.output_ids.append(0)


@pytest.mark.parametrize("budget", [0, -3])
def test_rejects_non_positive_prefill_budget(budget: int) -> None:
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(num_slots=2, max_prefill_tokens=budget)


def test_admits_in_arrival_order_into_lowest_slots_until_full() -> None:
    sched = Scheduler(num_slots=3, max_prefill_tokens=64)
    seqs = [seq(2) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    admitted = sched.admit()
    assert admitted == seqs[:3]
    assert [s.slot for s in admitted] == [0, 1, 2]
    assert [s.status for s in seqs] == [Status.RUNNING] * 3 + [Status.WAITING] * 2
    assert list(sched.waiting) == seqs[3:] and seqs[3].slot == -1
    # No slot free: nothing more gets in, however often we ask.
    assert sched.admit() == []
    assert list(sched.waiting) == seqs[3:]


def test_finished_sequence_frees_its_slot_for_the_next_waiting_one() -> None:
    sched = Scheduler(num_slots=3, max_prefill_tokens=64)
    a, b, c, d, e, f = (seq(2) for _ in range(6))
    for s in (a, b, c, d, e, f):
        sched.add(s)
    sched.admit()
    sched.finish(b)
    assert b.status is Status.FINISHED and b not in sched.running
    assert sched.admit() == [d] and d.slot == 1
    # Slots freed out of order are still handed out lowest first.
    sched.finish(c)
    sched.finish(a)
    assert sched.admit() == [e, f]
    assert (e.slot, f.slot) == (0, 2)


def test_finishing_twice_frees_the_slot_once() -> None:
    sched = Scheduler(num_slots=1, max_prefill_tokens=64)
    a, b, c = seq(2), seq(2), seq(2)
    sched.add(a)
    sched.admit()
    sched.finish(a)
    sched.finish(a)
    sched.add(b)
    sched.add(c)
    assert sched.admit() == [b]
    assert list(sched.waiting) == [c] and c.status is Status.WAITING


def test_finishing_a_waiting_sequence_drops_it_without_freeing_a_slot() -> None:
    sched = Scheduler(num_slots=1, max_prefill_tokens=64)
    a, b, c = seq(2), seq(2), seq(2)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    sched.finish(b)  # aborted while waiting
    assert b.status is Status.FINISHED and list(sched.waiting) == [c]
    assert sched.admit() == []  # a still holds the only slot
    sched.finish(a)
    assert sched.admit() == [c] and c.slot == 0


def test_has_work_until_everything_is_finished() -> None:
    sched = Scheduler(num_slots=1, max_prefill_tokens=64)
    assert not sched.has_work
    a, b = seq(2), seq(2)
    sched.add(a)
    sched.add(b)
    assert sched.has_work
    sched.admit()
    sched.finish(a)
    assert sched.has_work  # b is still waiting
    sched.admit()
    sched.finish(b)
    assert not sched.has_work


def prefill_steps(sched: Scheduler) -> list[tuple[Sequence, int, int, bool]]:
    """Every step's chunk until no prompt is left to cache."""
    steps = []
    while (chunk := sched.prefill_chunk()) is not None:
        steps.append((chunk.seq, chunk.start, chunk.end, chunk.is_last))
        run_prefill([chunk])
    return steps


def test_one_prompt_is_prefilled_a_step_in_admission_order() -> None:
    sched = Scheduler(num_slots=4, max_prefill_tokens=8)
    a, b, c = seq(5), seq(6), seq(3)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    # Never two prompts in one step, even when both would fit the budget: each is a pass of its own.
    assert prefill_steps(sched) == [(a, 0, 5, True), (b, 0, 6, True), (c, 0, 3, True)]
    assert sched.prefill_chunk() is None
    assert sched.decoding() == [a, b, c]


def test_long_prompt_is_chunked_and_holds_later_prompts_back() -> None:
    sched = Scheduler(num_slots=2, max_prefill_tokens=4)
    long, short = seq(10), seq(2)
    sched.add(long)
    sched.add(short)
    sched.admit()
    assert prefill_steps(sched) == [(long, 0, 4, False), (long, 4, 8, False), (long, 8, 10, True),
                                    (short, 0, 2, True)]


def test_budget_of_one_token_still_makes_progress() -> None:
    sched = Scheduler(num_slots=2, max_prefill_tokens=1)
    a, b = seq(2), seq(1)
    sched.add(a)
    sched.add(b)
    sched.admit()
    assert prefill_steps(sched) == [(a, 0, 1, False), (a, 1, 2, True), (b, 0, 1, True)]


def test_decoding_has_only_fully_prefilled_sequences_ordered_by_slot() -> None:
    sched = Scheduler(num_slots=3, max_prefill_tokens=4)
    a, b, c, d = seq(2), seq(2), seq(2), seq(9)
    for s in (a, b, c):
        sched.add(s)
    sched.admit()
    run_prefill([sched.prefill_chunk()])
    run_prefill([sched.prefill_chunk()])  # a and b fully, c not at all
    assert sched.decoding() == [a, b]
    # a leaves; d takes slot 0 and is admitted after b and c, but only b and c decode.
    sched.finish(a)
    sched.add(d)
    assert sched.admit() == [d] and d.slot == 0
    assert spans([sched.prefill_chunk()]) == [(c, 0, 2, True)]  # b decodes, so it is no candidate
    run_prefill([sched.prefill_chunk()])
    assert sched.decoding() == [b, c]
    assert prefill_steps(sched) == [(d, 0, 4, False), (d, 4, 8, False), (d, 8, 9, True)]
    # Admission order is [b, c, d], but decode batches follow slots: d sits in slot 0.
    assert sched.decoding() == [d, b, c]


def test_aborted_prefill_gives_way_to_the_next_prompt() -> None:
    sched = Scheduler(num_slots=2, max_prefill_tokens=4)
    a, b = seq(12), seq(3)
    sched.add(a)
    sched.add(b)
    sched.admit()
    run_prefill([sched.prefill_chunk()])  # a: [0, 4)
    sched.finish(a)
    assert spans([sched.prefill_chunk()]) == [(b, 0, 3, True)]


def test_a_free_slot_goes_to_the_tenant_with_the_fewest_running() -> None:
    sched = Scheduler(num_slots=4, max_prefill_tokens=64)
    flood = [seq(2, "flood") for _ in range(100)]
    for s in flood:
        sched.add(s)
    quiet = [seq(2, "quiet") for _ in range(3)]
    for s in quiet:
        sched.add(s)  # arrived after the whole flood
    admitted = sched.admit()
    assert [s.tenant for s in admitted] == ["flood", "quiet", "flood", "quiet"]
    sched.finish(admitted[0])  # a flood sequence ends: flood has 1 running, quiet 2
    assert sched.admit() == [flood[2]]
    sched.finish(admitted[1])  # a quiet one ends: quiet has 1 running, flood 2
    assert sched.admit() == [quiet[2]]
    assert sched.num_waiting == 100 - 3


def test_within_a_tenant_admission_stays_first_come_first_served() -> None:
    sched = Scheduler(num_slots=2, max_prefill_tokens=64)
    arrivals = [seq(2, tenant) for _ in range(3) for tenant in ("a", "b")]  # a, b, a, b, a, b
    a, b = arrivals[0::2], arrivals[1::2]
    for s in arrivals:
        sched.add(s)
    assert sched.admit() == [a[0], b[0]]
    assert sched.waiting == [a[1], b[1], a[2], b[2]]  # every waiting sequence, in arrival order


def test_waiting_sequences_leave_at_their_deadline() -> None:
    sched = Scheduler(num_slots=1, max_prefill_tokens=64)
    running, early, late, patient = seq(2), seq(2, deadline=10.0), seq(2, "t", deadline=20.0), seq(2)
    for s in (running, early, late, patient):
        sched.add(s)
    sched.admit()
    assert sched.expire(5.0) == []
    assert sched.expire(10.0) == [early]
    assert sched.waiting == [late, patient]
    assert sched.expire(1e9) == [late]
    assert sched.waiting == [patient] and sched.running == [running]  # a running sequence has no deadline

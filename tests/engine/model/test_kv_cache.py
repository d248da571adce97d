"""The KV cache and `AttnBatch` alone: the slot layout, per-pass metadata (positions, causal mask,
the consecutive-slot and uniform-start fast paths) for prefill, decode and verify passes, writes
landing at `start + j` of the right slot, reads, and rollback by overwriting dead rows."""

import pytest
import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.kv_cache import AttnBatch, KVCache

pytestmark = pytest.mark.timeout(30)

CPU = torch.device("cpu")
CONFIG = ModelConfig(arch="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, max_position=64)
SLOTS, MAX_LEN = 4, 8
T, F = True, False


def cache(dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(CONFIG, SLOTS, MAX_LEN, dtype, CPU)


def batch(slots: list[int], start: list[int], num_new: int) -> AttnBatch:
    return AttnBatch.build(slots, start, num_new, CPU, MAX_LEN)


def keys_for(b: int, n: int, code: int) -> torch.Tensor:
    """`[b, Hkv, n, D]` keys whose every entry spells where it came from: code, row, head, token, dim."""
    x = torch.zeros(b, CONFIG.num_kv_heads, n, CONFIG.head_dim)
    for i in range(b):
        for h in range(CONFIG.num_kv_heads):
            for j in range(n):
                for d in range(CONFIG.head_dim):
                    x[i, h, j, d] = code * 10000 + i * 1000 + h * 100 + j * 10 + d
    return x


@pytest.mark.parametrize(("num_slots", "max_len"), [(0, 8), (2, 0), (-1, 8)])
def test_rejects_empty_cache(num_slots: int, max_len: int) -> None:
    with pytest.raises(ValueError, match="num_slots > 0 and max_len > 0"):
        KVCache(CONFIG, num_slots, max_len, torch.float32, CPU)


@pytest.mark.parametrize(("dtype", "nbytes"), [(torch.float32, 2048), (torch.bfloat16, 1024)])
def test_layout_and_size(dtype: torch.dtype, nbytes: int) -> None:
    c = KVCache(CONFIG, 2, 8, dtype, CPU)
    # [layers, slots, kv_heads, max_len, head_dim] = 2 * 2 * 2 * 8 * 4 = 256 entries, for k and for v.
    assert c.k.shape == c.v.shape == (2, 2, 2, 8, 4)
    assert c.k.dtype == c.v.dtype == dtype
    assert not c.k.any() and not c.v.any()
    assert (c.num_slots, c.max_len, c.nbytes) == (2, 8, nbytes)


def test_prefill_chunk_batch() -> None:
    b = batch([2], [3], 4)  # prompt positions 3..6 of the sequence in slot 2
    assert b.size == 1 and b.num_new == 4 and b.kv_len == 7
    assert b.slots.tolist() == [2] and b.start.tolist() == [3]
    assert b.positions.tolist() == [[3, 4, 5, 6]]
    assert b.contiguous_from == 2 and b.uniform_start == 3
    assert b.mask is not None and b.mask.shape == (1, 1, 4, 7)
    assert b.mask[0, 0].tolist() == [
        [T, T, T, T, F, F, F],
        [T, T, T, T, T, F, F],
        [T, T, T, T, T, T, F],
        [T, T, T, T, T, T, T],
    ]


def test_decode_batch_with_equal_lengths_needs_no_mask() -> None:
    b = batch([0, 1, 2], [5, 5, 5], 1)
    assert b.mask is None
    assert b.kv_len == 6 and b.positions.tolist() == [[5], [5], [5]]
    assert b.contiguous_from == 0 and b.uniform_start == 5


def test_decode_batch_with_ragged_lengths_masks_each_row() -> None:
    b = batch([3, 1], [2, 4], 1)
    assert b.kv_len == 5 and b.positions.tolist() == [[2], [4]]
    assert b.contiguous_from is None and b.uniform_start is None
    assert b.mask is not None and b.mask.shape == (2, 1, 1, 5)
    assert b.mask[:, 0, 0].tolist() == [[T, T, T, F, F], [T, T, T, T, T]]


def test_verify_batch_masks_causally_from_each_start() -> None:
    b = batch([0, 1], [2, 1], 3)  # [t, d1, d2] for two sequences of cached lengths 2 and 1
    assert b.kv_len == 5 and b.positions.tolist() == [[2, 3, 4], [1, 2, 3]]
    assert b.contiguous_from == 0 and b.uniform_start is None
    assert b.mask is not None and b.mask.shape == (2, 1, 3, 5)
    assert b.mask[0, 0].tolist() == [[T, T, T, F, F], [T, T, T, T, F], [T, T, T, T, T]]
    assert b.mask[1, 0].tolist() == [[T, T, F, F, F], [T, T, T, F, F], [T, T, T, T, F]]


@pytest.mark.parametrize(("slots", "first"), [([1, 2, 3], 1), ([3], 3), ([0, 2], None), ([2, 1], None),
                                              ([1, 1], None)])
def test_contiguous_only_for_ascending_consecutive_slots(slots: list[int], first: int | None) -> None:
    assert batch(slots, [0] * len(slots), 1).contiguous_from == first


def test_batch_may_not_reach_past_the_cache() -> None:
    assert batch([0], [6], 2).kv_len == MAX_LEN  # exactly fills the slot
    with pytest.raises(AssertionError, match="past cache length"):
        batch([0], [6], 3)
    with pytest.raises(AssertionError, match="past cache length"):
        batch([0, 1], [1, 7], 2)


@pytest.mark.parametrize(("slots", "start", "num_new"), [
    ([1, 2], [3, 3], 2),  # consecutive, same start: the slice path
    ([3, 0], [1, 1], 2),  # non-consecutive slots
    ([0, 1, 2], [4, 0, 2], 3),  # consecutive but ragged starts
    ([2], [5], 1),  # one decode token
])
def test_write_lands_at_start_plus_j_of_each_slot(slots: list[int], start: list[int], num_new: int) -> None:
    c = cache()
    b = batch(slots, start, num_new)
    k, v = keys_for(len(slots), num_new, 1), -keys_for(len(slots), num_new, 1)
    c.write(1, b, k, v)
    expected = torch.zeros_like(c.k)
    for i, (slot, s0) in enumerate(zip(slots, start)):
        for j in range(num_new):
            expected[1, slot, :, s0 + j] = k[i, :, j]
    assert torch.equal(c.k, expected)  # nothing else touched: other layers, slots and positions stay 0
    assert torch.equal(c.v, -expected)


@pytest.mark.parametrize("slots", [[1, 2], [2, 0]])
def test_write_casts_into_the_cache_dtype(slots: list[int]) -> None:
    c = cache(torch.bfloat16)
    k = torch.tensor([1.5, -2.0, 0.25, 3.0]).repeat(2, 2, 1, 1)  # exact in bf16; [2, Hkv, 1, D]
    c.write(0, batch(slots, [4, 4], 1), k, 2 * k)
    assert c.k.dtype == torch.bfloat16
    assert c.k[0, slots[0], 1, 4].tolist() == [1.5, -2.0, 0.25, 3.0]
    assert c.v[0, slots[1], 0, 4].tolist() == [3.0, -4.0, 0.5, 6.0]


def test_read_returns_the_batch_slots_in_batch_order() -> None:
    c = cache()
    c.k[0, :, :, :, :] = torch.arange(SLOTS, dtype=torch.float32).view(SLOTS, 1, 1, 1) + 1  # slot s holds s + 1
    c.v[0] = -c.k[0]
    keys, values = c.read(0, batch([3, 1], [2, 4], 1))  # kv_len 5
    assert keys.shape == values.shape == (2, CONFIG.num_kv_heads, 5, CONFIG.head_dim)
    assert keys[:, 0, 0, 0].tolist() == [4.0, 2.0]
    assert values[:, 0, 0, 0].tolist() == [-4.0, -2.0]
    assert not c.read(1, batch([3, 1], [2, 4], 1))[0].any()  # layer 1 is still empty


def test_read_of_consecutive_slots_sees_later_writes() -> None:
    c = cache()
    b = batch([1, 2], [0, 0], 3)
    keys, _ = c.read(0, b)
    c.write(0, b, keys_for(2, 3, 2), keys_for(2, 3, 2))
    # A view, not a copy: what was written after the read shows through.
    assert torch.equal(keys, keys_for(2, 3, 2))


def test_rollback_is_overwriting_dead_rows() -> None:
    c = cache()
    c.write(0, batch([0], [0], 3), keys_for(1, 3, 1), keys_for(1, 3, 1))  # prompt of 3
    # Verify block [t, d1, d2, d3] at position 3; the target keeps t and d1 only: num_cached 3 -> 5.
    c.write(0, batch([0], [3], 4), keys_for(1, 4, 2), keys_for(1, 4, 2))
    # The next pass decodes x at 5, overwriting the dead row of d2; row 6 still holds the rejected
    # d3 but lies past what this pass reads.
    nxt = batch([0], [5], 1)
    c.write(0, nxt, keys_for(1, 1, 3), keys_for(1, 1, 3))
    keys, _ = c.read(0, nxt)
    assert keys.shape == (1, CONFIG.num_kv_heads, 6, CONFIG.head_dim)
    assert torch.equal(keys[:, :, :3], keys_for(1, 3, 1))
    assert torch.equal(keys[:, :, 3:5], keys_for(1, 4, 2)[:, :, :2])
    assert torch.equal(keys[:, :, 5:6], keys_for(1, 1, 3))
    assert torch.equal(c.k[0, 0, :, 6], keys_for(1, 4, 2)[0, :, 3])


@pytest.mark.parametrize(("slots", "start"), [([3, 4], [0, 0]), ([0, 4], [0, 0]), ([4, 0], [1, 2])])
def test_write_to_a_slot_past_the_cache_raises(slots: list[int], start: list[int]) -> None:
    c = cache()
    # Consecutive slots take the slicing path, which asserts; others index, and torch raises.
    with pytest.raises((AssertionError, IndexError, RuntimeError)):
        c.write(0, batch(slots, start, 1), keys_for(2, 1, 1), keys_for(2, 1, 1))


def test_single_slot_write_past_the_cache_raises() -> None:
    c = cache()
    with pytest.raises(AssertionError, match="past the cache"):
        c.write(0, batch([SLOTS], [0], 1), keys_for(1, 1, 1), keys_for(1, 1, 1))


def test_write_checks_the_block_shape() -> None:
    c = cache()
    with pytest.raises(AssertionError):
        c.write(0, batch([0, 1], [0, 0], 2), keys_for(2, 3, 1), keys_for(2, 3, 1))  # 3 tokens for num_new 2
    with pytest.raises(AssertionError):
        c.write(0, batch([0, 1], [0, 0], 2), keys_for(1, 2, 1), keys_for(1, 2, 1))  # 1 row for 2 sequences

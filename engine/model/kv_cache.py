"""The target model's KV cache: one fixed slot per running sequence, plus per-pass attention metadata.

Layout is `[layers, slots, kv_heads, max_len, head_dim]` for keys and for values. A sequence owns a
slot for its whole life; its length is owned by the engine (`Sequence.num_cached`), so rolling back
rejected draft tokens is just lowering that length: rows past it are dead and get overwritten.

Why slots and not pages: on the CPU, attention reads one contiguous `[kv_heads, len, head_dim]`
run per sequence, and a batch whose slots are consecutive reads the cache as a view with no copy.
The price is that capacity is counted in slots of `max_len` tokens, not in tokens.

This file is not the scheduler: admission control (waiting for a free slot) lives there.
"""

from dataclasses import dataclass

import torch

from specloop.engine.model.config import ModelConfig


class KVCache:
    """Preallocated keys and values. Mutated in place by `write`; not thread-safe (one engine thread)."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KV cache needs num_slots > 0 and max_len > 0, got {num_slots}, {max_len}")
        shape = (config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, T, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, T, D]
        self.num_slots = num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, batch: "AttnBatch", k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this pass's keys/values `[B, Hkv, n, D]` at positions `start + j` of each slot."""
        assert k.shape == v.shape and k.shape[0] == batch.size and k.shape[2] == batch.num_new
        if batch.contiguous_from is not None and batch.uniform_start is not None:
            s0, p0 = batch.contiguous_from, batch.uniform_start
            # A slice past the end is empty and would drop the write silently; indexing (below) raises.
            assert s0 + batch.size <= self.k.shape[1], f"slots {s0}..{s0 + batch.size - 1} past the cache"
            self.k[layer, s0:s0 + batch.size, :, p0:p0 + batch.num_new] = k
            self.v[layer, s0:s0 + batch.size, :, p0:p0 + batch.num_new] = v
            return
        heads = torch.arange(k.shape[1], device=k.device).view(1, -1, 1)
        slots = batch.slots.view(-1, 1, 1)
        pos = batch.positions.unsqueeze(1)  # [B, 1, n]
        self.k[layer][slots, heads, pos] = k.to(self.k.dtype)
        self.v[layer][slots, heads, pos] = v.to(self.v.dtype)

    def read(self, layer: int, batch: "AttnBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, Hkv, kv_len, D]` of the batch's slots: a view when slots are consecutive."""
        k, v = self.k[layer, :, :, :batch.kv_len], self.v[layer, :, :, :batch.kv_len]
        if batch.contiguous_from is not None:
            s0 = batch.contiguous_from
            return k[s0:s0 + batch.size], v[s0:s0 + batch.size]
        return k.index_select(0, batch.slots), v.index_select(0, batch.slots)


@dataclass(frozen=True)
class AttnBatch:
    """Where one forward pass reads and writes: B sequences, each with `num_new` new tokens.

    Token j of sequence b sits at position `start[b] + j` and sees cache positions `<= start[b] + j`.
    Sequences with fewer real tokens are right-padded; padded rows write dead cache rows past the
    sequence's length and their outputs are ignored by the caller.
    """

    slots: torch.Tensor  # [B] long
    start: torch.Tensor  # [B] long: tokens already cached for each sequence
    num_new: int
    kv_len: int  # keys to read: max(start) + num_new
    positions: torch.Tensor  # [B, n] long
    mask: torch.Tensor | None  # [B, 1, n, kv_len] bool, None when every query may see every key
    contiguous_from: int | None  # first slot when slots are consecutive, else None
    uniform_start: int | None  # the common start when all sequences start at the same length

    @property
    def size(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def build(cls, slots: list[int], start: list[int], num_new: int, device: torch.device,
              max_len: int) -> "AttnBatch":
        assert len(slots) == len(start) and num_new > 0
        kv_len = max(start) + num_new
        assert kv_len <= max_len, f"pass reaches position {kv_len} past cache length {max_len}"
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)
        start_t = torch.tensor(start, dtype=torch.long, device=device)
        positions = start_t.unsqueeze(1) + torch.arange(num_new, device=device)  # [B, n]
        needs_mask = num_new > 1 or len(set(start)) > 1
        mask = None
        if needs_mask:
            keys = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
            mask = keys <= positions.view(len(slots), 1, num_new, 1)  # [B, 1, n, kv_len]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        uniform = start[0] if len(set(start)) == 1 else None
        return cls(slots_t, start_t, num_new, kv_len, positions, mask,
                   slots[0] if consecutive else None, uniform)

"""Serving-time DFlash: keeps each slot's drafter context K/V and drafts one block per propose call.

`observe` fuses the target's tapped hidden states and writes every drafter layer's context
keys/values at the observed positions (a `KVCache` laid out like the target's, one slot per
sequence). `propose` runs the block `[last token, mask × k]` at positions `ctx_len .. ctx_len+k`
against the first `ctx_len` context rows of each slot (ragged lengths handled by a key mask) and
returns argmax drafts through the target's own LM head, which is borrowed, never copied into the
artifact. The block's own K/V are never cached: each propose starts from the context alone.

`observe` only holds the tapped rows; they are written (fused, projected, cached) when a block is
next drafted from that slot, all the positions held since in one call. Beside a lookup proposer
(`engine/speculation/combined.py`) DFlash drafts on few steps (one in about twelve on the demo's
formal-logic traffic, where suffix decoding drafts the rest), so a write is made once for many
steps, and of committed rows only: written at every observe, each verify block's rejected rows were
written too, and each call paid about 0.3 ms before its first position (SmolLM2's shipped drafter,
bf16, Zen 3: 0.42 ms for 4 positions, 0.96 for 16, 7.8 for 256). On 16 formal-logic prompts at
concurrency 8 the drafter's context cost 0.15 s of a 13 s run held against 0.33 s of 15 s written
at every step (1,529 positions in 40 calls against 3,473 in 129; no script kept).

On the CPU both run in the C++ kernel (`FusedDrafter` in `engine/cpu/fused_decode.py`) when it builds:
the block pass in one call instead of some 40 small eager ops, and the context writes in one call
after the fusion linear. Measured in the engine (SmolLM2 bf16, one sequence, block 4, natural-length
answers), per step: propose 1.86 → 1.37 ms, observe 0.91 → 0.74 ms; most of what is left of a
propose is the head (13,205 rows, 15 MB read per block), which runs as a `CpuLinear` like the
target's. Elsewhere, and for blocks too large for the kernel, the eager path below.

Not here: the drafter maths (`engine/speculation/dflash.py`), the verify rule (`engine/speculation/verify.py`).
"""

import torch
from torch import nn

from specloop.engine.cpu.fused_decode import fused_drafter
from specloop.engine.cpu.linear import for_cpu_inference, optimize_for_cpu_inference
from specloop.engine.model.attention import cache_dtype
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.proposer import Proposer

# A slot's rows held unwritten before `observe` writes them: bounds the memory (3 taps ≈ 7 KB a position).
HELD_POSITIONS = 256


class DFlashProposer(Proposer):
    def __init__(self, drafter: DFlashDrafter, target: Transformer, block_size: int | None = None) -> None:
        c = drafter.config
        c.check_target(target.config)
        block_size = block_size or c.block_size
        if not 2 <= block_size <= c.block_size:
            raise ValueError(f"block_size must be in 2..{c.block_size} (the trained block size), got {block_size}")
        self.drafter = optimize_for_cpu_inference(drafter.to(device=target.device, dtype=target.dtype).eval())
        self.target = target
        self.block_size = block_size
        self.tap_layers = c.tap_layers
        self.head = _head(drafter, target)
        self.fused = fused_drafter(self.drafter)  # the C++ block pass on the CPU; None elsewhere
        self.cache: KVCache | None = None
        self.last_expected: list[float] = []  # per row of the last `propose`: drafts it expects accepted
        # slot -> observed (start, tapped rows `[n, T·H]`) not yet written, contiguous, in position order
        self._held: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.held_positions = HELD_POSITIONS  # 0: every observe writes at once (benchmarks compare the two)

    def allocate(self, num_slots: int, max_len: int) -> None:
        d = self.drafter
        self._held.clear()
        self.cache = KVCache(d.config.model_config, num_slots, max_len, cache_dtype(self.target.dtype, self.target.device), self.target.device)

    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        assert self.cache is not None, "allocate() before observe()"
        rows = torch.cat(taps, dim=-1)  # [B, n, T·H]
        full = []
        for b, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            # A part from `start` on replaces what was held there (a verify block's rejected rows), and
            # one from before the held ones (the slot's next sequence) replaces all of them. Only the
            # tail is cut: a slot holds up to 256 one-row parts (decode steps that did not draft), and
            # cutting every part cost 7.1 ms a step at 8 slots holding 200-300 (0.14 ms now). Live, the
            # demo's traffic at concurrency 8 held far fewer: 0.96x plain before, 0.92x after, within
            # noise (one interleaved run, Zen 3; no script kept).
            held = self._held.setdefault(slot, [])
            while held and held[-1][0] >= start:
                held.pop()
            if held and held[-1][0] + len(held[-1][1]) > start:
                held[-1] = (held[-1][0], held[-1][1][:start - held[-1][0]])
            assert not held or held[-1][0] + len(held[-1][1]) == start, "observed positions must be contiguous"
            held.append((start, rows[b].clone()))  # a copy: a view would hold the whole batch's
            if start + rows.shape[1] - held[0][0] > self.held_positions:
                full.append(slot)
        self.write(full)

    def release(self, slot: int, tokens: list[int]) -> None:
        self._held.pop(slot, None)

    @torch.no_grad()
    def write(self, slots: list[int] | None = None) -> None:
        """Write the held rows of `slots` (all when None) into the context cache: one call per number
        of positions held (every slot has the same in steps where DFlash drafts at every step)."""
        groups: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # positions -> [(slot, start, rows)]
        for slot in list(self._held) if slots is None else slots:
            parts = self._held.pop(slot, [])
            if parts:
                rows = torch.cat([r for _, r in parts])  # [n, T·H]
                groups.setdefault(len(rows), []).append((slot, parts[0][0], rows))
        for group in groups.values():
            self._write([g[0] for g in group], [g[1] for g in group], torch.stack([g[2] for g in group]))

    def _write(self, slots: list[int], starts: list[int], rows: torch.Tensor) -> None:
        """Tapped rows `[B, n, T·H]` at positions `starts[b] ..` of `slots[b]` → the drafter's context K/V."""
        assert self.cache is not None
        n = rows.shape[1]
        fused = self.drafter.fuse_rows(rows)  # [B, n, H]
        if self.fused is not None and self.cache.k.dtype == torch.float32:
            self.fused.write_context(fused, slots, starts, self.cache)
            return
        batch = AttnBatch.build(slots, starts, n, self.target.device, self.cache.max_len)
        for layer, (k, v) in enumerate(self.drafter.context_kv(fused, batch.positions)):
            self.cache.write(layer, batch, k, v)

    @torch.no_grad()
    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        logits = self.block_logits(slots, ctx_lens, last_tokens)  # [B, k, V']
        top, ids = logits.softmax(dim=-1).max(dim=-1)  # [B, k] each
        # Its own estimate of how many drafts are accepted: the drafts of a block are drawn
        # independently, so each is accepted with those before it with the product of their
        # probabilities. Only the combined proposer weighs it; the engine verifies DFlash's drafts
        # whole (`last_confidence` stays None), so that a drafter unsure of itself still shows in τ,
        # which the canary and the rollback watch judge it by.
        self.last_expected = top.cumprod(dim=1).sum(dim=1).tolist()
        return self.drafter.vocab_ids[ids] if self.drafter.trimmed else ids

    def block_logits(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits `[B, k, V']` over the drafter's output vocabulary (the slots' held rows written first)."""
        assert self.cache is not None, "allocate() before propose()"
        self.write(slots)
        device, B = self.target.device, len(slots)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        lens = torch.tensor(ctx_lens, dtype=torch.long, device=device)
        x = self.drafter.embed_block(last_tokens.to(device).view(B, 1), self.block_size, self.target.embed)  # [B, bs, H]
        if self.fused is not None and self.fused.accepts(B, self.block_size, self.cache):
            hidden = self.fused.forward(x, slot_t, lens, self.cache)
        else:
            hidden = self._run_eager(x, slot_t, lens)
        return self.head(hidden[:, 1:]).float()

    def _run_eager(self, x: torch.Tensor, slot_t: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Blocks x `[B, bs, H]` at positions `lens[b] ..` of `slot_t[b]` → final-normed hidden `[B, bs, H]`."""
        assert self.cache is not None
        B, bs, _ = x.shape
        T, device = int(lens.max()), x.device
        ctx = [(self.cache.k[i, slot_t, :, :T], self.cache.v[i, slot_t, :, :T])  # [B, Hkv, T, D]
               for i in range(self.drafter.config.num_layers)]
        sees_ctx = torch.arange(T, device=device).view(1, -1) < lens.view(-1, 1)  # [B, T]
        mask = torch.cat([sees_ctx, torch.ones(B, bs, dtype=torch.bool, device=device)], dim=1)
        mask = mask.view(B, 1, 1, T + bs).expand(B, 1, bs, T + bs)
        positions = lens.view(-1, 1) + torch.arange(bs, device=device)  # [B, bs]
        return self.drafter.run_blocks(x, positions, ctx, mask)


def _head(drafter: DFlashDrafter, target: Transformer) -> nn.Module:
    """The drafter's output layer: the target's LM head, or a private copy of its kept rows when the
    vocabulary is trimmed (slicing 49152 rows on every call would cost more than the drafter layer
    itself), as a CPU-inference linear like the target's own."""
    if not drafter.trimmed:
        return target.lm_head
    rows = drafter.head_weight(target.lm_head).detach()  # [V', H]
    head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    head.weight = nn.Parameter(rows.clone(), requires_grad=False)
    return for_cpu_inference(head)

"""Runs the target model over the KV cache: prefill chunks, one-token decode, and k+1-token verify.

It owns the cache and turns sequences into `AttnBatch`es and token tensors; it returns logits and,
when a proposer needs them, the tapped hidden states. It does not sample, accept or stream: that is
`engine/runtime/llm_engine.py`.
"""

from collections.abc import Sequence as Seq

import torch

from specloop.engine.model.attention import cache_dtype
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model: Transformer, num_slots: int, max_len: int, slack: int) -> None:
        """`slack` extra cache rows per slot absorb the dead writes of a verify block near max_len."""
        self.model = model
        self.device = model.device
        self.max_len = max_len
        self.cache = KVCache(model.config, num_slots, max_len + slack, cache_dtype(model.dtype, self.device),
                             self.device)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, start: int, end: int, taps: Seq[int],
                every_position: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cache prompt positions [start, end) of one sequence; logits `[V]` of the last one, or `[n, V]`
        of every one with `every_position` (prompt log-probabilities)."""
        tokens = torch.tensor([seq.prompt_ids[start:end]], dtype=torch.long, device=self.device)  # [1, n]
        batch = AttnBatch.build([seq.slot], [start], end - start, self.device, self.cache.max_len)
        hidden, tapped = self.model(tokens, self.cache, batch, taps)
        return self.model.logits(hidden[0] if every_position else hidden[0, -1]), tapped

    @torch.inference_mode()
    def run_block(self, seqs: list[Sequence], block: torch.Tensor, taps: Seq[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Feed each sequence `block[b]` `[B, n]` at its cached length; logits `[B, n, V]`.

        n == 1 is plain decoding (the block is the last committed token); n == k+1 is a verify pass.
        """
        B, n = block.shape
        assert B == len(seqs)
        batch = AttnBatch.build([s.slot for s in seqs], [s.num_cached for s in seqs], n, self.device,
                                self.cache.max_len)
        hidden, tapped = self.model(block.to(self.device), self.cache, batch, taps)
        return self.model.logits(hidden), tapped

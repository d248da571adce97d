"""N-gram prompt lookup: the untrained baseline drafter every learned drafter is compared against.

Take the last n committed tokens (n from `max_ngram` down to `min_ngram`), find their most recent
earlier occurrence in the sequence's own history (prompt + output), and propose the tokens that
followed it. It needs no target hidden states and no per-slot state.

Always k = block_size − 1 drafts: when no n-gram matches, or the continuation is shorter than k,
the missing positions repeat the last token (verification rejects them at no extra cost, since
the verify block has a fixed length anyway). `last_scores` tells the caller, per row of the
last `propose`, the n that matched (0 for none), which the combined proposer uses as confidence.
"""

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specloop.engine.speculation.proposer import StatelessProposer


def lookup(history: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix, and its n."""
    arr = np.asarray(history, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        suffix = arr[-n:]
        # Windows over arr[:-1] start at most at len−1−n, so each match has a following token and
        # the suffix never matches itself.
        windows = sliding_window_view(arr[:-1], n)  # [len−n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist(), n
    return [], 0


class NgramProposer(StatelessProposer):
    def __init__(self, block_size: int = 8, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.block_size = block_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_scores: list[float] = []

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        k = self.num_drafts
        rows, lengths = [], []
        for history in histories:
            found, n = lookup(history, k, self.max_ngram, self.min_ngram)
            filler = found[-1] if found else history[-1]
            rows.append(found + [filler] * (k - len(found)))
            lengths.append(n)
        self.last_scores = [float(n) for n in lengths]
        return torch.tensor(rows, dtype=torch.long).view(len(histories), k)

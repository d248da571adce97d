"""What the engine asks of a drafter (`Proposer`), and the combined DFlash + n-gram proposer.

The engine owns the target pass, acceptance and rollback (`engine/speculation.py`); a proposer only
watches what the target computed (`observe`) and guesses what comes next (`propose`). Proposers
always return exactly k = block_size − 1 drafts per row: positions they have nothing for are
filled with a plausible token and simply get rejected by verification, so the engine never needs
per-row draft lengths.

This file is not a drafter: the DFlash proposer is in `engine/dflash_proposer.py`, n-gram lookup in
`engine/ngram.py`.
"""

import abc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.dflash_proposer import DFlashProposer
    from engine.ngram import NgramProposer


class Proposer(abc.ABC):
    """A drafter with per-slot state. Used from the engine's one thread; not thread-safe."""

    block_size: int  # verify block length = 1 + number of drafts (k = block_size − 1)
    tap_layers: tuple[int, ...]  # target layers whose outputs `observe` needs; () when none

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @abc.abstractmethod
    def allocate(self, num_slots: int, max_len: int) -> None:
        """Create per-slot state for `num_slots` sequences of up to `max_len` positions."""

    def release(self, slot: int) -> None:
        """The sequence in `slot` finished. Nothing to drop by default: per-slot rows are positional,
        and the slot's next owner overwrites them from position zero before it reads any."""

    @abc.abstractmethod
    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        """After every target pass: `taps[i]` `[B, n, H]` is the output of layer `tap_layers[i]` for tokens
        `token_ids` `[B, n]`, written at positions `starts[b] .. starts[b]+n−1` of `slots[b]`.

        Rows past what the engine later commits are dead; a later call may overwrite them.
        """

    @abc.abstractmethod
    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        """Drafts `[B, k]` long for sequences whose first `ctx_lens[b]` positions are observed and committed and
        whose last committed token `last_tokens[b]` `[B]` is not yet in the target cache.

        `histories[b]` is every committed token of the sequence (prompt + output), ending in `last_tokens[b]`.
        """


class StatelessProposer(Proposer):
    """A proposer that keeps no per-slot state and needs no hidden states (n-gram lookup, test doubles)."""

    tap_layers: tuple[int, ...] = ()

    def allocate(self, num_slots: int, max_len: int) -> None:
        pass

    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        pass


class CombinedProposer(Proposer):
    """N-gram lookup when it found a match of at least `min_match` tokens, DFlash otherwise.

    Why this rule: a match in the prompt or output (code repeating a name, a quoted passage) is
    often right for many tokens in a row, while without one n-gram lookup has nothing to offer.
    How long a match must be depends on how good the drafter is. On 72 held-out evals answers of
    SmolLM2 at B = 4, with a drafter trained 55 minutes (DFlash τ 1.80, n-gram 2.35): combined
    2.53 with min_match 1, 2.69 with 2, 2.71 with 3. With a weak drafter (HumanEval, trained 9
    minutes, DFlash 1.17) 1 was best: 2.49 vs 2.25 with 3. DFlash runs only on the rows that need it.
    """

    def __init__(self, dflash: "DFlashProposer", ngram: "NgramProposer", min_match: int = 3) -> None:
        if dflash.block_size != ngram.block_size:
            raise ValueError(f"block sizes differ: dflash {dflash.block_size}, ngram {ngram.block_size}")
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.dflash, self.ngram, self.min_match = dflash, ngram, min_match
        self.block_size = dflash.block_size
        self.tap_layers = dflash.tap_layers

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.dflash.allocate(num_slots, max_len)
        self.ngram.allocate(num_slots, max_len)

    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        self.dflash.observe(slots, starts, taps, token_ids)

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        drafts = self.ngram.propose(slots, ctx_lens, last_tokens, histories)  # [B, k]
        rows = [b for b, n in enumerate(self.ngram.last_match_lengths) if n < self.min_match]
        if rows:
            learned = self.dflash.propose([slots[b] for b in rows], [ctx_lens[b] for b in rows],
                                          last_tokens[rows], [histories[b] for b in rows])
            drafts[rows] = learned.to(drafts.device)
        return drafts

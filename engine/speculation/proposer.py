"""What the engine asks of a drafter: the `Proposer` interface, its stateless base, and
`ServedDrafter`, a proposer with the drafter version it serves.

The engine owns the target pass, the verify rule and rollback (`engine/speculation/verify.py`); a proposer only
watches what the target computed (`observe`) and guesses what comes next (`propose`). Proposers
always return exactly k = block_size − 1 drafts per row: positions they have nothing for are
filled with a plausible token and simply get rejected by verification, so the engine never needs
per-row draft lengths.

This file is not a drafter: the DFlash proposer is in `engine/speculation/dflash_proposer.py`, n-gram
lookup in `engine/speculation/ngram.py`, the two together in `engine/speculation/combined.py`.
"""

import abc
from dataclasses import dataclass

import torch


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


@dataclass(frozen=True, eq=False)
class ServedDrafter:
    """A proposer as the engine serves it. `version` names the drafter it drafts with (a registry
    version such as `v3`, or an artifact directory's name) in metrics, traces and `/v1/models`;
    None for a proposer without a learned drafter (n-gram lookup).

    Compared by identity: each swap serves a new one, even of the same version.
    """

    proposer: Proposer
    version: str | None = None

"""What the engine asks of a drafter: the `Proposer` interface, its stateless base, and
`ServedDrafter`, a proposer with the drafter version it serves.

The engine owns the target pass, the verify rule and rollback (`engine/speculation/verify.py`); a proposer only
watches what the target computed (`observe`) and guesses what comes next (`propose`). Proposers
always return k = block_size − 1 columns per row: positions they have nothing for are either filled
with a plausible token (n-gram lookup; verification rejects it) or -1, which ends the row's draft, so
that a step verifies at most as many positions as its longest draft (suffix decoding; how many it
does verify is `engine/runtime/verify_cost.py`'s choice).

This file is not a drafter: the DFlash proposer is in `engine/speculation/dflash_proposer.py`, n-gram
lookup in `engine/speculation/ngram.py`, suffix decoding in `engine/speculation/suffix.py`, a lookup
and DFlash together in `engine/speculation/combined.py`.
"""

import abc
from dataclasses import dataclass

import torch

NO_DRAFT = -1  # a row's draft ended before this position


def draft_lengths(drafts: torch.Tensor) -> torch.Tensor:
    """How many drafts each row of `drafts` `[B, k]` has before its first `NO_DRAFT` → `[B]` long."""
    return (drafts != NO_DRAFT).long().cumprod(dim=1).sum(dim=1)


class Proposer(abc.ABC):
    """A drafter with per-slot state. Used from the engine's one thread; not thread-safe."""

    block_size: int  # verify block length = 1 + number of drafts (k = block_size − 1)
    tap_layers: tuple[int, ...]  # target layers whose outputs `observe` needs; () when none
    # After `propose`: `[B, k]` estimated probability that each draft is accepted (with all before it),
    # which the engine weighs against the cost of verifying it (engine/runtime/verify_cost.py);
    # None: every draft counts as certain.
    last_confidence: torch.Tensor | None = None

    @property
    def num_drafts(self) -> int:
        return self.block_size - 1

    @abc.abstractmethod
    def allocate(self, num_slots: int, max_len: int) -> None:
        """Create per-slot state for `num_slots` sequences of up to `max_len` positions."""

    def begin(self, slot: int, namespace: str | None) -> None:
        """A sequence takes `slot`, before its prompt is observed. `namespace` is whose earlier requests it
        may draft from (its tenant), or None for none; only suffix decoding keeps anything per tenant."""

    def release(self, slot: int, tokens: list[int]) -> None:
        """The sequence in `slot` finished with `tokens` (prompt + output). Nothing to drop by default:
        per-slot rows are positional, and the slot's next owner overwrites them from position zero
        before it reads any."""

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
        whose last committed token `last_tokens[b]` `[B]` is not yet in the target cache. A row may end
        in -1s where it has nothing more to draft (`NO_DRAFT`); the engine then verifies fewer positions.

        `histories[b]` is every committed token of the sequence (prompt + output), ending in `last_tokens[b]`.
        """

    def verified(self, verified: list[int], accepted: list[int]) -> None:
        """After the verify pass of the last `propose`'s drafts: per row, how many of its drafts were
        verified and how many of those accepted. Proposers that estimate acceptance learn from it
        (`engine/speculation/calibration.py`); nothing by default."""


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

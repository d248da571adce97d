"""The combined proposer: a lookup proposer (n-gram lookup or suffix decoding) where it is confident
enough, DFlash elsewhere.

It only routes rows between two proposers; neither drafter's logic is here
(`engine/speculation/ngram.py`, `engine/speculation/suffix.py`, `engine/speculation/dflash_proposer.py`).
"""

import torch

from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import NO_DRAFT, Proposer
from specloop.engine.speculation.suffix import SuffixProposer


class CombinedProposer(Proposer):
    """The lookup's draft for rows whose score (`last_scores`) reached `min_score`; DFlash's otherwise,
    unless (suffix decoding) the lookup expects more of its draft accepted than DFlash does of its own.

    Why this rule: a match in the prompt, the output or (suffix decoding) the tenant's earlier
    requests is often right for many tokens in a row, while without one a lookup has nothing to
    offer. N-gram lookup scores a row by its match length. How long a match must be depends on how
    good the drafter is. On 72 held-out evals answers of SmolLM2 at B = 4, with a drafter trained 55
    minutes (DFlash τ 1.80, n-gram 2.35): combined 2.53 with min_match 1, 2.69 with 2, 2.71 with 3.
    With a weak drafter (HumanEval, trained 9 minutes, DFlash 1.17) 1 was best: 2.49 vs 2.25 with 3.
    Suffix decoding scores a row by the drafts it expects accepted (`engine/speculation/suffix.py`),
    and DFlash estimates the same from its own probabilities (`last_expected`), so below
    `min_score` each row drafts with whichever expects more. DFlash runs only on the rows that need
    it; the block is the longer of the two proposers', and DFlash's rows end in `NO_DRAFT` past its own.
    """

    def __init__(self, dflash: DFlashProposer, lookup: NgramProposer | SuffixProposer, min_score: float = 3) -> None:
        if min_score <= 0:
            raise ValueError(f"min_score must be > 0, got {min_score}")
        self.dflash, self.lookup, self.min_score = dflash, lookup, min_score
        self.block_size = max(dflash.block_size, lookup.block_size)
        self.tap_layers = dflash.tap_layers
        self.last_learned: list[int] = []  # rows (batch indices) of the last `propose` that DFlash ran on
        # Rows proposed for, rows DFlash was asked for (the lookup short of `min_score`), rows whose draft
        # was DFlash's: how much of the traffic the drafter can speed up at all (docs/performance.md).
        self.rows_proposed = self.rows_asked = self.rows_learned = 0
        self.last_taken: set[int] = set()  # rows of the last propose whose drafts are DFlash's

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.dflash.allocate(num_slots, max_len)
        self.lookup.allocate(num_slots, max_len)

    def begin(self, slot: int, namespace: str | None) -> None:
        self.lookup.begin(slot, namespace)

    def release(self, slot: int, tokens: list[int]) -> None:
        self.dflash.release(slot, tokens)
        self.lookup.release(slot, tokens)

    def observe(self, slots: list[int], starts: list[int], taps: list[torch.Tensor], token_ids: torch.Tensor) -> None:
        self.dflash.observe(slots, starts, taps, token_ids)

    def propose(self, slots: list[int], ctx_lens: list[int], last_tokens: torch.Tensor,
                histories: list[list[int]]) -> torch.Tensor:
        drafts = torch.full((len(slots), self.num_drafts), NO_DRAFT, dtype=torch.long)  # [B, k]
        confidence = torch.ones(len(slots), self.num_drafts)  # [B, k]; n-gram's and DFlash's drafts count as certain
        found = self.lookup.propose(slots, ctx_lens, last_tokens, histories)  # [B, k_lookup]
        drafts[:, :found.shape[1]] = found
        weighed = self.lookup.last_confidence is not None  # suffix decoding: its estimates against DFlash's
        if weighed:
            confidence[:, :found.shape[1]] = self.lookup.last_confidence
        rows = [b for b, score in enumerate(self.lookup.last_scores) if score < self.min_score]
        self.last_taken = set()
        self.last_learned = rows
        self.rows_proposed += len(slots)
        self.rows_asked += len(rows)
        if rows:
            learned = self.dflash.propose([slots[b] for b in rows], [ctx_lens[b] for b in rows],
                                          last_tokens[rows], [histories[b] for b in rows])  # [R, k_dflash]
            own = getattr(self.dflash, "last_expected", None) or [float(learned.shape[1])] * len(rows)
            take = [i for i, b in enumerate(rows) if not weighed or own[i] >= self.lookup.last_scores[b]]
            self.rows_learned += len(take)
            if take:
                chosen = [rows[i] for i in take]
                self.last_taken = set(chosen)
                drafts[chosen] = NO_DRAFT
                drafts[chosen, :learned.shape[1]] = learned[take].to(drafts.device)
                confidence[chosen] = 1.0  # verified whole, as DFlash alone is (dflash_proposer.py)
        self.last_confidence = confidence
        return drafts

    def verified(self, verified: list[int], accepted: list[int]) -> None:
        """The lookup learns from the rows it drafted, not from those DFlash's drafts replaced."""
        self.lookup.verified([0 if b in self.last_taken else v for b, v in enumerate(verified)], accepted)

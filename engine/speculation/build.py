"""The proposer a server drafts with, built from its kind and, for the learned kinds, a DFlash drafter.

Kinds: `ngram` (prompt lookup, no drafter), `dflash` (the drafter alone) and `combined` (n-gram
lookup where it matched at least 3 tokens, the drafter elsewhere). `specloop serve` builds one at
start-up and the registry follower builds one for every new champion, both through `build_proposer`.
Not here: reading artifacts (`drafter_artifact.py`) or deciding which drafter serves
(`engine/server/drafter_follower.py`).
"""

from typing import Literal

from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer

ProposerKind = Literal["ngram", "dflash", "combined"]

# Block 4: on held-out evals prompts (bf16, batch 1) n-gram at block 3/4/8 ran 1.13x/1.12x/0.87x plain
# decoding; longer blocks draft more than gets accepted (docs/performance.md, "Speculative decoding").
NGRAM_BLOCK_SIZE = 4


def build_proposer(kind: ProposerKind, target: Transformer, drafter: DFlashDrafter | None = None,
                   block_size: int | None = None) -> Proposer:
    """`block_size` None: the drafter's trained block, or `NGRAM_BLOCK_SIZE` for n-gram lookup alone."""
    if kind == "ngram":
        return NgramProposer(block_size=block_size or NGRAM_BLOCK_SIZE)
    if drafter is None:
        raise ValueError(f"proposer {kind!r} needs a DFlash drafter")
    dflash = DFlashProposer(drafter, target, block_size)
    if kind == "dflash":
        return dflash
    return CombinedProposer(dflash, NgramProposer(block_size=dflash.block_size))


def dflash_of(proposer: Proposer) -> DFlashProposer | None:
    """The DFlash proposer inside `proposer`, if it has one."""
    if isinstance(proposer, CombinedProposer):
        return proposer.dflash
    return proposer if isinstance(proposer, DFlashProposer) else None

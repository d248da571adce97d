"""The proposer a server drafts with, built from its kind (`engine/speculation/kinds.py`) and, for the
learned kinds, a DFlash drafter. `specloop serve` builds one at start-up and
the registry follower builds one for every new champion, both through `build_proposer`, handing
every suffix proposer the server's one `SuffixCache`, so a swap keeps what the cache learned.
Not here: reading artifacts (`drafter_artifact.py`) or deciding which drafter serves
(`engine/server/drafter_follower.py`).
"""

from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.combined import CombinedProposer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.kinds import ProposerKind
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer
from specloop.engine.speculation.suffix_cache import SuffixCache

# Block 4: on held-out evals prompts (bf16, batch 1) n-gram at block 3/4/8 ran 1.13x/1.12x/0.87x plain
# decoding; longer blocks draft more than gets accepted (docs/performance.md, "Speculative decoding").
NGRAM_BLOCK_SIZE = 4
# Suffix decoding drafts only as far as its matches reach, and a step verifies only as wide as its
# longest draft, so a long block costs nothing when it goes unused.
SUFFIX_BLOCK_SIZE = 16
# dflash+suffix: suffix decoding's draft when it expects at least this many drafts accepted.
SUFFIX_MIN_SCORE = 1.0


def build_proposer(kind: ProposerKind, target: Transformer, drafter: DFlashDrafter | None = None,
                   block_size: int | None = None, suffix_cache: SuffixCache | None = None,
                   max_block_size: int = SUFFIX_BLOCK_SIZE) -> Proposer:
    """`block_size` None: the drafter's trained block, or `NGRAM_BLOCK_SIZE` / `SUFFIX_BLOCK_SIZE` for the
    lookups alone. `suffix_cache` None: suffix decoding drafts from each request's own context only.
    `max_block_size`: the engine's; suffix decoding's block is cut to it."""
    suffix_block = min(SUFFIX_BLOCK_SIZE, max_block_size)
    if kind == "ngram":
        return NgramProposer(block_size=block_size or NGRAM_BLOCK_SIZE)
    if kind == "suffix":
        return SuffixProposer(SuffixConfig(block_size=block_size or suffix_block), suffix_cache)
    if drafter is None:
        raise ValueError(f"proposer {kind!r} needs a DFlash drafter")
    dflash = DFlashProposer(drafter, target, block_size)
    if kind == "dflash":
        return dflash
    if kind == "combined":
        return CombinedProposer(dflash, NgramProposer(block_size=dflash.block_size))
    suffix = SuffixProposer(SuffixConfig(block_size=max(suffix_block, dflash.block_size)), suffix_cache)
    return CombinedProposer(dflash, suffix, SUFFIX_MIN_SCORE)


def dflash_of(proposer: Proposer) -> DFlashProposer | None:
    """The DFlash proposer inside `proposer`, if it has one."""
    if isinstance(proposer, CombinedProposer):
        return proposer.dflash
    return proposer if isinstance(proposer, DFlashProposer) else None

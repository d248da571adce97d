"""Which training positions suffix decoding drafts in the drafter's place, so the drafter can train on
the others.

Serving drafts with `dflash+suffix` (`engine/speculation/combined.py`): after a position where suffix
decoding expects at least `SUFFIX_MIN_SCORE` drafts accepted, its draft is taken and DFlash does not
run. Blocks anchored there train drafts nobody uses. This replays the training sequences in arrival
order through suffix decoding as serving met them: each sequence's positions are looked up in its
own context and a cache holding the sequences before it, then it is added to the cache.

It costs one suffix lookup per response position, in Python, before the first step (and in every
process under torchrun); the trainer logs its seconds. Held-out loss, which early stopping keeps the
best weights by, still counts every position.

Not here: sampling anchors (`daemon/training/objective.py`), the rule itself
(`engine/speculation/combined.py`).
"""

import numpy as np
import torch

from specloop.engine.speculation.build import SUFFIX_BLOCK_SIZE, SUFFIX_MIN_SCORE
from specloop.engine.speculation.suffix import SuffixConfig, SuffixProposer
from specloop.engine.speculation.suffix_cache import SuffixCache
from specloop.storage.sequences import TokenSequence

_NAMESPACE = "training"  # one tenant: the dataset's traces are the deployment's traffic


def suffix_covered(sequences: list[TokenSequence], max_len: int) -> list[torch.Tensor]:
    """Per sequence, `[min(len(tokens), max_len)]` bool: True at response positions after which suffix
    decoding drafts in DFlash's place."""
    cache = SuffixCache()
    proposer = SuffixProposer(SuffixConfig(block_size=SUFFIX_BLOCK_SIZE), cache)
    out = []
    for seq in sequences:
        tokens = np.asarray(seq.tokens[:max_len], dtype=np.int32)  # [S]
        covered = torch.zeros(len(tokens), dtype=torch.bool)
        for p in range(len(seq.prompt), len(tokens) - 1):
            covered[p] = proposer.draft(tokens[:p + 1], _NAMESPACE).score >= SUFFIX_MIN_SCORE
        cache.add(_NAMESPACE, list(seq.tokens))
        out.append(covered)
    return out

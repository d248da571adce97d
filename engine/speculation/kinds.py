"""The kinds of proposer a server can draft with, and which one serves by default. Names only: no
torch, so settings and the CLI can import it (`engine/speculation/build.py` builds them).

`ngram` (prompt lookup, no drafter), `suffix` (suffix decoding over the request and its tenant's
recent requests, no drafter), `dflash` (the drafter alone), `combined` (n-gram lookup where it
matched at least 3 tokens, the drafter elsewhere) and `dflash+suffix` (suffix decoding where it
expects enough drafts accepted, the drafter elsewhere).
"""

from typing import Literal, get_args

ProposerKind = Literal["ngram", "suffix", "dflash", "combined", "dflash+suffix"]
LEARNED_KINDS: tuple[ProposerKind, ...] = ("dflash", "combined", "dflash+suffix")
# What drafts with a drafter when a server is not told ("auto"), what the daemon's contest replays and
# what `tau_canary` is measured with. Suffix decoding alone was faster than it at concurrency 8 on
# every set measured (docs/performance.md, "Suffix decoding"), so serving does not assume the drafter
# pays: an engine benches a champion the contest found short of the policy's margin over suffix
# decoding alone (`engine/server/drafter_follower.py`).
DEFAULT_LEARNED_KIND: ProposerKind = "dflash+suffix"
assert set(LEARNED_KINDS) < set(get_args(ProposerKind)) and DEFAULT_LEARNED_KIND in LEARNED_KINDS


def lookup_kind(kind: ProposerKind) -> ProposerKind | None:
    """What drafts without a drafter for `kind` (before the registry's first champion, after a failed
    one): the kind itself for the lookups, the lookup half of a combined kind, None for dflash."""
    return {"combined": "ngram", "dflash+suffix": "suffix", "dflash": None}.get(kind, kind)

"""PII mode "strip": a trace's token ids without the tokens that spell what the detectors found.

The trainer reads only token ids, so blanking text fields protected nothing. Here the ids themselves
lose the personal data: in the prompt (context the trainer feeds the target), each token that overlaps
a finding is replaced by the tokens of `PLACEHOLDER`; in the response (what the drafter learns to
predict, so it must stay what the target generated), everything from the first token that overlaps
a finding on is cut. A response cut to nothing leaves nothing to learn: `strip` returns None and the
trace is dropped.

Offsets: a finding's span is in `decode(ids)`; the tokens it covers are found by bisecting over the
length of decoded prefixes (a prefix of ids decodes to a prefix of the text, up to a character a
token splits, which counts as overlapping), O(log n) decodes per finding. The stripped ids are
scanned again, and a trace that still holds a finding is dropped, so a tokenizer whose prefixes
decode differently cannot leak one. Works with any tokenizer's `decode`/`encode`; not here:
deciding whether to capture (`consent/capture.py`), building the trace.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specloop.consent import pii

PLACEHOLDER = "[redacted]"

Decode = Callable[[list[int]], str]
Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class Stripped:
    prompt_ids: list[int]
    response_ids: list[int]
    prompt_findings: int
    response_findings: int


def strip(prompt_ids: Sequence[int], response_ids: Sequence[int], decode: Decode, encode: Encode) -> Stripped | None:
    """The ids with every finding's tokens gone (see the module docstring); None when the response
    would be left empty or the stripped ids still hold a finding."""
    prompt, prompt_spans = _replace(list(prompt_ids), decode, encode(PLACEHOLDER))
    response = list(response_ids)
    found = pii.scan(decode(response))
    if found:
        response = response[:_first_token_at(response, found[0].start, decode)]
    if not response or _still_found(prompt, decode) or _still_found(response, decode):
        return None
    return Stripped(prompt, response, prompt_spans, len(found))


def _still_found(ids: list[int], decode: Decode) -> bool:
    """Whether the stripped ids still spell a finding: a tokenizer whose prefixes do not decode to
    prefixes of the text, or tokens that join into a new one. The trace is then dropped."""
    return next(pii.findings(decode(ids)), None) is not None


def _replace(ids: list[int], decode: Decode, placeholder: list[int]) -> tuple[list[int], int]:
    """`ids` with the tokens of each finding replaced by `placeholder`; how many findings."""
    found = pii.scan(decode(ids))
    out, done = [], 0
    for f in found:
        first = _first_token_at(ids, f.start, decode)
        end = _tokens_covering(ids, f.end, decode)
        if first < done:  # overlaps the previous finding's tokens: already replaced
            first = done
        out += ids[done:first] + (placeholder if end > first else [])
        done = max(done, end)
    return out + ids[done:], len(found)


def _first_token_at(ids: list[int], char: int, decode: Decode) -> int:
    """The index of the token that holds character `char` of decode(ids): the smallest k whose
    prefix ids[:k + 1] decodes past `char`."""
    lo, hi = 0, len(ids)  # invariant: decode(ids[:lo]) ends at or before `char`
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _tokens_covering(ids: list[int], char_end: int, decode: Decode) -> int:
    """The smallest k whose prefix ids[:k] decodes to at least `char_end` characters, and no
    character left half spelled (U+FFFD: a token split its bytes, the next token holds the rest)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= char_end:
            hi = mid
        else:
            lo = mid + 1
    while lo < len(ids) and decode(ids[:lo]).endswith("\ufffd"):
        lo += 1
    return lo

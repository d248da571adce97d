"""Text as the PII detectors read it: one spelling per character class, with a map back to the original.

Obfuscation that a reader sees through must not get past the detectors: full-width "４１１１" or
"＠", Arabic-Indic or Devanagari digits, a zero-width space inside an address, an en dash or a
minus sign between digit groups. `normalized(text)` folds each character by NFKC, maps every
Unicode decimal digit to its ASCII digit, every dash to "-", every space separator to " ", and
drops format characters (zero-width spaces and joiners, soft hyphens, bidi marks). `origin[i]` is
the index in the original text of normalized character i, so findings point into what the client sent.

ASCII text, almost all traffic, is returned as is without a per-character pass. Not here: the
detectors (`consent/pii.py`), and words spelled out to hide an address ("at", "dot"), which the
email detector matches on the normalized text.
"""

import unicodedata
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, slots=True)
class Normalized:
    text: str
    origin: tuple[int, ...] | None  # None: the text is the original (ASCII), offsets are the same

    def span(self, start: int, end: int, original_length: int) -> tuple[int, int]:
        """The original span of normalized characters [start, end)."""
        if self.origin is None:
            return start, end
        assert 0 <= start < end <= len(self.text), (start, end, len(self.text))
        last = self.origin[end - 1]
        # One original character can fold to several (NFKC of "㎏" is "kg"); the span ends after it.
        return self.origin[start], next((o for o in self.origin[end:] if o > last), original_length)


def normalized(text: str) -> Normalized:
    """`text` folded for matching, with the map back to the original's offsets."""
    if text.isascii():
        return Normalized(text, None)
    out: list[str] = []
    origin: list[int] = []
    for i, ch in enumerate(text):
        folded = _fold(ch)
        out.append(folded)
        origin.extend([i] * len(folded))
    return Normalized("".join(out), tuple(origin))


@lru_cache(maxsize=8192)
def _fold(ch: str) -> str:
    """What one character reads as: "" for a format character, else its NFKC form with digits,
    dashes and spaces made ASCII."""
    category = unicodedata.category(ch)
    if category == "Cf":
        return ""
    if category == "Nd":
        return str(unicodedata.decimal(ch))
    if category == "Pd" or ch == "\u2212":  # U+2212 MINUS SIGN is a math symbol (Sm), read as a dash
        return "-"
    if category == "Zs":
        return " "
    return unicodedata.normalize("NFKC", ch)  # full-width forms, "＠", superscript and circled digits

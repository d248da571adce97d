"""Detectors for personal data and secrets in prompt and response text.

`findings(text)` yields `Finding(kind, start, end)` spans, detector by detector, so a caller that only
needs to know whether anything is present stops at the first one. Findings carry offsets into the
text as given, never the matched text, so they are safe to log. Detectors read the text normalized
(`consent/pii_text.py`: full-width and non-ASCII digits, dashes, spaces and zero-width characters
folded), so an obfuscation a reader sees through does not get past them. This module decides
nothing about capture (`consent/capture.py` does).

Recall and false positives on an obfuscated corpus: docs/data-governance.md (benchmarks/pii_screen.py).
Decisions on ambiguous text (each pinned by a test in tests/consent/test_pii.py):
- Email: a Unicode local part and domain (IDN addresses), or spelled out to hide it: "name at
  example dot com", "name [at] example (dot) com", "name @ example . com". A bracketed "at"/"dot"
  takes any top-level domain; bare words or spaced symbols only a common one (`_COMMON_TLDS`), so
  "x @ weights . shape" in code is not an address.
- Payment card: 13-19 digits, contiguous or in 4-digit groups (4-6-5 / 4-6-4 for Amex and Diners)
  separated by 1-3 of space, dash, dot, slash or underscore, mixed or doubled, starting with a
  major-network digit (2-6), passing Luhn (`stdnum.luhn`), not all one digit. UATP (leading 1) is
  not covered.
- IBAN and national ids: `consent/pii_ids.py` (python-stdnum's validators).
- IPv4: a valid dotted quad (octets 0-255, no leading zeros) is an address, even 1.2.3.4, unless it
  is loopback or unspecified (127.0.0.1, 0.0.0.0), is part of a longer dotted run (1.2.3.4.5), is
  written as a version (v1.2.3.4) or directly follows the word "version" or "release". A four-part
  version elsewhere is flagged: dropping one trace costs less than storing an address.
- IPv6: any text `ipaddress` accepts with at least two non-empty groups (fe80::1, full 8-group
  forms); "::1", two decimal groups (the slice x[1::2]), clock times (12:30:45) and MAC addresses
  are not.
- Phone: what the `phonenumbers` library finds valid, with "+" and a country code, or in the
  national format of one of `PHONE_REGIONS`, written with a "+", a separator or parentheses. Bare
  digit runs are not phones (far more often ids and timestamps), nor are decimals: one dot, dots
  mixed with other separators, a leading "0." ("39.0021", "0.549 / 0.317", "(1.64) / 1.50"); in
  national format a number needs 9 digits or more.
  ISO and day-first dates are masked first ("2025-06-01 12" would read as a Washington number).
- Secret: known prefixes (sk-, AKIA/ASIA, ghp_/gho_/ghu_/ghs_/ghr_, github_pat_, xox?-, AIza, JWTs,
  PEM private keys), plus tokens of 32+ base64/url-safe characters that mix upper, lower and digits
  and look random: at least 2 digit runs and a character-class switch at 40% of positions or more
  (CamelCase identifiers measure 0.30-0.39; random base62 tokens 0.42 at their 1st percentile).
  Pure hex (commit hashes, checksums) is not a secret.
"""

import ipaddress
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

import phonenumbers
from stdnum import luhn

from specloop.consent import pii_ids
from specloop.consent.pii_text import normalized


class PiiKind(StrEnum):
    EMAIL = "email"
    PHONE = "phone"
    PAYMENT_CARD = "payment_card"
    IBAN = "iban"
    NATIONAL_ID = "national_id"
    IPV4 = "ipv4"
    IPV6 = "ipv6"
    SECRET = "secret"


@dataclass(frozen=True, slots=True)
class Finding:
    kind: PiiKind
    start: int
    end: int


# National formats are read for these regions; "+" and a country code, for every region.
PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN")
_COMMON_TLDS = frozenset(
    "com net org edu gov mil int info biz io co ai app dev me tv xyz online site tech eu us uk de fr es it nl be "
    "ch at se no dk fi pl pt ie ru ua cn jp kr tw hk sg in au nz ca mx br ar cl za".split())
_EMAIL = re.compile(
    r"(?<![\w.%+-])[\w.%+-]{1,64}@[\w-]{1,63}(?:\.[\w-]{1,63})*\.(?:[^\W\d_]{2,24}|xn--[\w-]{2,59})(?![\w-])"
)
# A spelled-out "at": bracketed "(at)" / "[@]", a bare word, or "@" with a space beside it (plain
# addresses are `_EMAIL`'s). Found first, then the address around it: scanning for whole spelled
# addresses from every position cost 0.29 s on the 1.2 MB negative corpus, this 0.18 s (Zen 3, busy).
_SPELLED_AT = re.compile(r"(?i)[(\[{<]\s*(?:at|@)\s*[)\]}>]|\s+at\s+|\s@\s*|@\s")
_LOCAL_TAIL = re.compile(r"(?<![\w.%+-])[\w.%+-]{1,64}\s*$")
_DOT = r"(?:\s*[(\[{<]\s*(?:dot|\.)\s*[)\]}>]\s*|\s+dot\s+|\s*\.\s*)"
_DOMAIN_HEAD = re.compile(rf"(?i)\s*[\w-]{{1,63}}(?:{_DOT}[\w-]{{1,63}})*{_DOT}([^\W\d_]{{2,24}})(?![\w-])")
_BRACKETED = re.compile(r"[(\[{<]\s*(?:at|@|dot|\.)\s*[)\]}>]", re.IGNORECASE)
_SEP = r"[ ./_-]{1,3}"
_CARD = re.compile(
    rf"(?<!\d)(?:\d{{13,19}}|\d{{4}}(?:{_SEP}\d{{4}}){{2}}{_SEP}\d{{1,7}}|\d{{4}}{_SEP}\d{{6}}{_SEP}\d{{4,5}})(?!\d)"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)")
_VERSION_WORD = re.compile(r"(?i)\b(?:version|release)\s*$")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_SECRET = re.compile(
    r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{20,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|gh[pousr]_[A-Za-z0-9]{36,}"
    r"|github_pat_[A-Za-z0-9_]{22,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"
    r"|AIza[0-9A-Za-z_-]{35}"
    r"|eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})"
    r"|-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
)
_TOKEN = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_=-]{32,}(?![A-Za-z0-9+/_=-])")
_SECRET_PREFIXES = ("sk-", "AKIA", "ASIA", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_",
                    "xox", "AIza", "eyJ", "-----BEGIN")
_HEX_CHARS = frozenset("0123456789abcdefABCDEF")
# Cards, phones, IPv4 addresses and numeric national ids all lie inside a run of 7+ digits and
# separators; one pass finds those runs and the precise patterns run only around them. Measured on
# 16 KB of chat text: 0.44 ms for this pass against 3.3 ms for the patterns over the whole text.
_NUMERIC = re.compile(r"\d[\d ./()_-]{5,}\d")
# A phone number is at most 15 digits with separators: a longer run is read in windows of 64
# characters overlapping by a phone's length, and only windows holding a phone's shape (7+ digits
# in groups of 2+, or "+" and 7+ digits) reach `phonenumbers`, which costs 0.06-0.5 ms per window and
# region and up to 1.4 ms on a window dense with digit groups (Zen 3). A text gets 64 such windows
# and one more per 512 characters, 512 at most (0.7 s); past them it is taken to hold a number
# rather than read through (SVG paths and coordinate lists can be). Numbers in national format have
# at least 9 digits here: shorter ones that some region accepts are far more often data ("36742 7"
# in an SVG path) than a phone.
_PHONE_WINDOW, _PHONE_SPAN = 64, 32
_PHONE_BUDGET, _PHONE_BUDGET_PER_CHAR, _PHONE_BUDGET_MAX = 64, 1 / 512, 512
_PHONE_SHAPE = re.compile(r"\+\d{7,15}|(?:\+\d{1,3}|\(?\d{2,}\)?)(?:[ ./-]{1,2}\(?\d{2,}\)?){1,6}")
_NATIONAL_MIN_DIGITS = 9
_TRUNK = re.compile(r"(?<!\d)0\d")
_DATE = re.compile(r"\d{4}([-/.])\d{1,2}\1\d{1,2}|\d{1,2}([-/.])\d{1,2}\2\d{4}")  # not phones, however many digits
_HEX = re.compile(r"[0-9a-fA-F]+")
_DIGIT_RUN = re.compile(r"\d+")


def findings(text: str) -> Iterator[Finding]:
    """Every finding in `text`, grouped by detector (not sorted by position)."""
    norm = normalized(text)
    for detect in _DETECTORS:
        for f in detect(norm.text):
            start, end = norm.span(f.start, f.end, len(text))
            yield Finding(f.kind, start, end)


def scan(text: str) -> list[Finding]:
    """Every finding in `text`, sorted by position."""
    return sorted(findings(text), key=lambda f: (f.start, f.end))


def _emails(text: str) -> Iterator[Finding]:
    if "@" in text:
        yield from (Finding(PiiKind.EMAIL, m.start(), m.end()) for m in _EMAIL.finditer(text))
    for at in _SPELLED_AT.finditer(text):
        local = _LOCAL_TAIL.search(text, max(0, at.start() - 66), at.start())
        domain = _DOMAIN_HEAD.match(text, at.end())
        if local is not None and domain is not None and _spelled_out(text[local.start():domain.end()], domain[1]):
            yield Finding(PiiKind.EMAIL, local.start(), domain.end())


def _spelled_out(address: str, tld: str) -> bool:
    """A spelled-out address, not prose or code that happens to match (see the module's docstring)."""
    return _BRACKETED.search(address) is not None or tld.lower() in _COMMON_TLDS


def _numbers(text: str) -> Iterator[Finding]:
    budget = [min(_PHONE_BUDGET + int(len(text) * _PHONE_BUDGET_PER_CHAR), _PHONE_BUDGET_MAX)]  # windows left
    for run in _NUMERIC.finditer(text):
        # One character before for "+" or "(", two after so lookaheads see what follows the run.
        lo, hi = max(0, run.start() - 1), min(len(text), run.end() + 2)
        yield from _cards(text, lo, hi)
        if sum(ch.isdigit() for ch in run.group()) >= 7:  # the shortest valid national numbers have 7
            yield from _phones(text, lo, hi, budget)
        yield from _ipv4s(text, lo, hi)
        ids_lo, ids_hi = max(0, run.start() - pii_ids.REACH), min(len(text), run.end() + pii_ids.REACH)
        yield from (Finding(PiiKind.NATIONAL_ID, *m) for m in pii_ids.numeric_ids(text, ids_lo, ids_hi))


def _identifiers(text: str) -> Iterator[Finding]:
    yield from (Finding(PiiKind.IBAN, *m) for m in pii_ids.ibans(text))
    yield from (Finding(PiiKind.NATIONAL_ID, *m) for m in pii_ids.tax_codes(text))


def _phones(text: str, lo: int, hi: int, budget: list[int]) -> Iterator[Finding]:
    seen: set[tuple[int, int]] = set()
    for start in range(lo, hi, _PHONE_WINDOW - _PHONE_SPAN):
        # "2025-06-01 12" reads as a Washington number: dates are masked, offsets kept.
        window = _DATE.sub(lambda d: "x" * len(d.group()), text[start:min(hi, start + _PHONE_WINDOW)])
        if not any(_could_be_phone(m.group()) for m in _PHONE_SHAPE.finditer(window)):
            continue
        budget[0] -= 1
        if budget[0] < 0:  # numbers everywhere: read as holding a phone number rather than read through
            yield Finding(PiiKind.PHONE, lo, hi)
            return
        # National numbers of the regions after the first begin with their trunk prefix 0.
        regions = PHONE_REGIONS if _TRUNK.search(window) else PHONE_REGIONS[:1]
        for region in regions:
            for m in phonenumbers.PhoneNumberMatcher(window, region, leniency=phonenumbers.Leniency.VALID):
                span = (start + m.start, start + m.end)
                if span not in seen and _phone_shaped(m.raw_string):
                    seen.add(span)
                    yield Finding(PiiKind.PHONE, *span)
            if seen:
                break


def _could_be_phone(shape: str) -> bool:
    """Worth asking `phonenumbers` about: 7+ digits, and no decimals ("73.3557 43.7790")."""
    if sum(ch.isdigit() for ch in shape) < 7:
        return False
    return shape.startswith("+") or "." not in shape or (shape.count(".") >= 2 and not any(c in shape for c in " /()-"))


def _phone_shaped(raw: str) -> bool:
    """Written as a phone number: not a bare digit run (an id or a timestamp far more often), not
    decimals ("39.0021", "0.549 / 0.317", "(1.64) / 1.50": one dot, dots mixed with other separators,
    a leading "0."), at least `_NATIONAL_MIN_DIGITS` digits in national format."""
    if raw.startswith("+"):
        return True
    if raw.isdigit() or raw.startswith("0.") or sum(ch.isdigit() for ch in raw) < _NATIONAL_MIN_DIGITS:
        return False
    return _could_be_phone(raw)


def _cards(text: str, lo: int, hi: int) -> Iterator[Finding]:
    for m in _CARD.finditer(text, lo, hi):
        digits = "".join(ch for ch in m.group() if ch.isdigit())
        if 13 <= len(digits) <= 19 and digits[0] in "23456" and len(set(digits)) > 1 and luhn.is_valid(digits):
            yield Finding(PiiKind.PAYMENT_CARD, m.start(), m.end())


def _ipv4s(text: str, lo: int, hi: int) -> Iterator[Finding]:
    for m in _IPV4.finditer(text, lo, hi):
        before = text[max(0, m.start() - 12) : m.start()]
        if before.endswith(("v", "V")) or _VERSION_WORD.search(before) is not None:
            continue
        address = ipaddress.IPv4Address(m.group())
        if not (address.is_loopback or address.is_unspecified):  # 127.0.0.1 and 0.0.0.0 name no one
            yield Finding(PiiKind.IPV4, m.start(), m.end())


def _ipv6s(text: str) -> Iterator[Finding]:
    """Tries the pattern only where a colon is, from the start of the hex group before it: code
    is full of colons, and a scan over the whole text cost 1.2 ms per 16 KB against 0.2 ms."""
    pos = text.find(":")
    while pos != -1:
        start = pos
        while start > 0 and pos - start < 4 and text[start - 1] in _HEX_CHARS:
            start -= 1
        m = _IPV6.match(text, start)
        if m is not None and _is_ipv6(m.group()):
            yield Finding(PiiKind.IPV6, m.start(), m.end())
            pos = m.end()
        pos = text.find(":", pos + 1)


def _is_ipv6(candidate: str) -> bool:
    groups = [g for g in candidate.split(":") if g]
    if len(groups) < 2 or (len(groups) == 2 and all(g.isdigit() for g in groups)):  # x[1::2] is a slice
        return False
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


def _secrets(text: str) -> Iterator[Finding]:
    if any(prefix in text for prefix in _SECRET_PREFIXES):
        yield from (Finding(PiiKind.SECRET, m.start(), m.end()) for m in _SECRET.finditer(text))
    for m in _TOKEN.finditer(text):
        if _looks_random(m.group()):
            yield Finding(PiiKind.SECRET, m.start(), m.end())


def _looks_random(token: str) -> bool:
    if _HEX.fullmatch(token) or len(_DIGIT_RUN.findall(token)) < 2:
        return False
    if token.lower() == token or token.upper() == token:
        return False
    classes = [_char_class(ch) for ch in token]
    switches = sum(a != b for a, b in zip(classes, classes[1:])) / (len(token) - 1)
    return switches >= 0.4 and _entropy_bits(token) >= 3.5


def _char_class(ch: str) -> int:
    return 0 if ch.isupper() else 1 if ch.islower() else 2 if ch.isdigit() else 3


def _entropy_bits(token: str) -> float:
    n = len(token)
    return -sum(c / n * math.log2(c / n) for c in Counter(token).values())


_DETECTORS: tuple[Callable[[str], Iterator[Finding]], ...] = (
    _emails, _numbers, _identifiers, _secrets, _ipv6s,
)

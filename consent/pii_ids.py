"""Checksummed identifiers in normalized text: bank accounts (IBAN) and national identity numbers.

Each detector is a shape (a regular expression over `consent/pii_text.py`'s normalized text) and a
validator from `python-stdnum`, which keeps each country's checksum and range rules: a shape alone
would flag every 9- or 11-digit number. Covered, with the shape each must be written in:
- IBAN, any country stdnum knows: 2 capital letters, 2 check digits, 11-30 capitals or digits,
  compact or in groups of 4 by spaces or dashes; mod-97 and the country's length and format.
- US SSN "ddd-dd-dddd" (no checksum exists: stdnum's area/group/serial rules and its list of
  advertised numbers); Brazil CPF "ddd.ddd.ddd-dd"; Spain DNI "dddddddd-L" and NIE "X-ddddddd-L";
  Italy codice fiscale; India Aadhaar "dddd dddd dddd" (Verhoeff); China resident id (18, with
  its date and checksum); France NIR (15 digits, key mod 97).
Shapes written without their separators are left alone where the bare digits are common in code and
data (9 digits for an SSN, 11 for a CPF, 12 for an Aadhaar): a checksum passes 1 in 10 of those.
Not here: cards (Luhn, in `consent/pii.py`), phone numbers, normalization, finding the runs of
digits that the numeric ids are read around (`consent/pii.py`).
"""

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

from stdnum import iban
from stdnum.br import cpf
from stdnum.cn import ric
from stdnum.es import dni, nie
from stdnum.fr import nir
from stdnum.in_ import aadhaar
from stdnum.it import codicefiscale
from stdnum.us import ssn


class Match(NamedTuple):
    start: int
    end: int


# Compact, or in groups of 4 (the last shorter); upper case, as IBANs are printed.
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?:[A-Z0-9]{11,30}|(?:[ -][A-Z0-9]{4}){2,7}(?:[ -][A-Z0-9]{1,4})?)"
                   r"(?![A-Za-z0-9])")
# Shapes made of digits (and a letter at either end): read only around the runs of digits that
# `consent/pii.py` finds for cards and phones. Over the whole text, these eight passes cost 0.38 s on
# the 1.2 MB negative corpus (benchmarks/pii_corpus.py); one alternation of them, 0.62 s.
_NUMERIC_IDS: tuple[tuple[re.Pattern[str], Callable[[str], bool]], ...] = (
    (re.compile(r"(?<![\d-])\d{3}-\d{2}-\d{4}(?![\d-])"), ssn.is_valid),
    (re.compile(r"(?<![\d.])\d{3}\.\d{3}\.\d{3}-\d{2}(?!\d)"), cpf.is_valid),
    (re.compile(r"(?<![\dA-Za-z])\d{8}-?[A-Za-z](?![A-Za-z\d])"), dni.is_valid),
    (re.compile(r"(?<![\dA-Za-z])[XYZxyz]-?\d{7}-?[A-Za-z](?![A-Za-z\d])"), nie.is_valid),
    (re.compile(r"(?<!\d)(?<!\d[ -])\d{4}([ -])\d{4}\1\d{4}(?!\d|[ -]\d)"), aadhaar.is_valid),
    (re.compile(r"(?<!\d)\d{17}[\dXx](?![\dA-Za-z])"), ric.is_valid),
    (re.compile(r"(?<!\d)[12] ?\d{2} ?\d{2} ?(?:\d{2}|2[AB]) ?\d{3} ?\d{3} ?\d{2}(?!\d)"), nir.is_valid),
)
_CODICE_FISCALE = re.compile(r"(?<![A-Za-z\d])[A-Za-z]{6}\d{2}[A-Za-z]\d{2}[A-Za-z]\d{3}[A-Za-z](?![A-Za-z\d])")
# How far a numeric id reaches beyond its run of digits: NIE's "X-" before, DNI's "-Z" after.
REACH = 2


def ibans(text: str) -> Iterator[Match]:
    for m in _IBAN.finditer(text):
        if iban.is_valid(m.group()):
            yield Match(m.start(), m.end())


def tax_codes(text: str) -> Iterator[Match]:
    """Italy's codice fiscale (letters and digits, so read over the whole text)."""
    for m in _CODICE_FISCALE.finditer(text):
        if codicefiscale.is_valid(m.group()):
            yield Match(m.start(), m.end())


def numeric_ids(text: str, lo: int, hi: int) -> Iterator[Match]:
    """National ids within text[lo:hi], a run of digits and separators widened by `REACH`."""
    for pattern, valid in _NUMERIC_IDS:
        for m in pattern.finditer(text, lo, hi):
            if valid(m.group()):
                yield Match(m.start(), m.end())

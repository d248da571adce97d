"""PII and secret detectors: what each one must find, and what it must leave alone."""

import random
import string

import pytest

from specloop.consent.pii import PiiKind, scan


def kinds(text: str) -> set[PiiKind]:
    return {f.kind for f in scan(text)}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("mail me at alice.smith+spec@example.co.uk today", PiiKind.EMAIL),
        ("call +1 415 555 0132 please", PiiKind.PHONE),
        ("uk office: +44 20 7946 0958", PiiKind.PHONE),
        ("phone (415) 555-0132", PiiKind.PHONE),
        ("phone 415-555-0132.", PiiKind.PHONE),
        ("phone 415.555.0132", PiiKind.PHONE),
        ("visa 4111 1111 1111 1111 exp 12/26", PiiKind.PAYMENT_CARD),
        ("card:4111-1111-1111-1111", PiiKind.PAYMENT_CARD),
        ("4111111111111111", PiiKind.PAYMENT_CARD),
        ("amex 3782 822463 10005", PiiKind.PAYMENT_CARD),
        ("mastercard 5555555555554444.", PiiKind.PAYMENT_CARD),
        ("ssh to 203.0.113.7 now", PiiKind.IPV4),
        ("the host 1.2.3.4 is down", PiiKind.IPV4),
        ("peer=[2001:db8::8a2e:370:7334]:443", PiiKind.IPV6),
        ("link-local fe80::1 on eth0", PiiKind.IPV6),
        ("2001:0db8:0000:0000:0000:ff00:0042:8329", PiiKind.IPV6),
        ("OPENAI_API_KEY=sk-proj-abcDEF1234567890ghijKLMN", PiiKind.SECRET),
        ("aws AKIAIOSFODNN7EXAMPLE key", PiiKind.SECRET),
        ("token ghp_" + "a1B2" * 9, PiiKind.SECRET),
        ("slack xoxb-123456789012-abcdefghij", PiiKind.SECRET),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk=", PiiKind.SECRET),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9", PiiKind.SECRET),
        ("secret: wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY9z", PiiKind.SECRET),
        # obfuscated: what a reader sees through, the screen must too
        ("write to alice at example dot com", PiiKind.EMAIL),
        ("write to j.doe [at] mail (dot) example [dot] xyz", PiiKind.EMAIL),
        ("write to ALICE AT EXAMPLE DOT ORG", PiiKind.EMAIL),
        ("write to alice @ example . co . uk", PiiKind.EMAIL),
        ("write to alice＠example.com", PiiKind.EMAIL),
        ("write to müller@bücher.de", PiiKind.EMAIL),
        ("write to 用户@例子.中国", PiiKind.EMAIL),
        ("write to ali\u200bce@exam\u200bple.com", PiiKind.EMAIL),
        ("card ４１１１ １１１１ １１１１ １１１１", PiiKind.PAYMENT_CARD),
        ("card ٤١١١-١١١١-١١١١-١١١١", PiiKind.PAYMENT_CARD),
        ("card 4111 1111-1111.1111", PiiKind.PAYMENT_CARD),
        ("card 4111--1111--1111--1111", PiiKind.PAYMENT_CARD),
        ("card 4111\u20131111\u20131111\u20131111", PiiKind.PAYMENT_CARD),
        ("card 4111\u200b1111\u200b1111\u200b1111", PiiKind.PAYMENT_CARD),
        ("call +1\u2212415\u2212555\u22120132", PiiKind.PHONE),
        ("call ０２０ ７９４６ ０９５８", PiiKind.PHONE),
        ("appelez le 06 12 34 56 78", PiiKind.PHONE),
        ("iban GB82 WEST 1234 5698 7654 32", PiiKind.IBAN),
        ("iban DE89370400440532013000.", PiiKind.IBAN),
        ("ssn 078-05-1121", PiiKind.NATIONAL_ID),
        ("cpf 390.533.447-05", PiiKind.NATIONAL_ID),
        ("dni 12345678-Z", PiiKind.NATIONAL_ID),
        ("codice fiscale RSSMRA85T10A562S", PiiKind.NATIONAL_ID),
        ("aadhaar 2341 2341 2346", PiiKind.NATIONAL_ID),
        ("身份证 11010519491231002X", PiiKind.NATIONAL_ID),
    ],
)
def test_finds(text: str, kind: PiiKind) -> None:
    assert kind in kinds(text)


@pytest.mark.parametrize(
    "text",
    [
        "plain prose about speculative decoding with no identifiers at all",
        "decorator @property and user@localhost",
        "order 4111111111111112 is not a card: it fails Luhn",
        "0000 0000 0000 0000 passes Luhn but is no card",
        "timestamp 1717243200000000000 in nanoseconds",
        "install v1.2.3.4 of the tool",
        "upgrade to version 10.0.19041.1",
        "release 4.2.1.0 is out",
        "semantic version 1.2.3 and 1.2.3.4.5",
        "octet with leading zero 01.2.3.4",
        "not an address: 256.1.1.1",
        "meeting at 12:30:45, loopback ::1",
        "C++ std::vector<int> and Foo::Bar::baz",
        "mac 00:1a:2b:3c:4d:5e",
        "id 4155550132 without separators",
        "dates 2025-06-01 and 2025.06.01",
        "commit 3f0a3b4b8e1e6e2f3ad1a59e3f1f1bfb6a56b2d6 and sha256 "
        "9b74c9897bac770ffc029102a200c5de0e1d8c2f0f2e7d3b3c8f7f3a1e0c6b2d",
        "uuid 123e4567-e89b-12d3-a456-426614174000",
        "class AbstractSingletonProxyFactoryBean1 and TestCaptureDecisionsForEveryReason2024",
        "path com/example/project/service/impl/UserServiceImpl2.java",
        "task-manager-service-with-a-long-name-2024",
        "1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7",
        "serve on 127.0.0.1 or 0.0.0.0",
        "every other item: xs[1::2], ys[0::3]",
        "ratios 0.549 / 0.317 / 0.176 and (1.64) / 1.50",
        "look at the dot product of a and b",
        "y = x @ weights . shape",
        "ssn-shaped but never issued: 666-12-3456 and 900-12-3456",
        "iban-shaped, wrong check digits: GB00 WEST 1234 5698 7654 32",
        "log 2025-06-01 12:30:45 2025-06-02 08:15:00",
    ],
)
def test_leaves_alone(text: str) -> None:
    assert kinds(text) == set()


def test_spans_point_at_the_match() -> None:
    text = "a: bob@example.org, b: 10.1.2.3"
    spans = [(f.kind, text[f.start : f.end]) for f in scan(text)]
    assert spans == [(PiiKind.EMAIL, "bob@example.org"), (PiiKind.IPV4, "10.1.2.3")]


def test_spans_point_into_the_text_as_sent() -> None:
    """Normalization folds and drops characters; a finding's offsets are still the original's."""
    text = "ｘ\u200b\u200b 会 ４１１１ １１１１ １１１１ １１１１ end, bob＠example.org"
    spans = [(f.kind, text[f.start : f.end]) for f in scan(text)]
    assert spans == [(PiiKind.PAYMENT_CARD, "４１１１ １１１１ １１１１ １１１１"), (PiiKind.EMAIL, "bob＠example.org")]


def test_a_text_of_numbers_is_read_as_holding_one() -> None:
    """Past the phone library's budget a text is flagged, not read through (fail closed); bare
    digit runs never reach the library, so any number of them is read."""
    assert PiiKind.PHONE in kinds(" ".join(f"12 {i:05d}" for i in range(400)))
    assert kinds(" ".join(f"12 {i:05d}" for i in range(20))) == set()
    assert kinds(" ".join(f"id 12{i:05d}" for i in range(4000))) == set()


def test_random_tokens_caught_identifiers_not() -> None:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits
    tokens = ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(500)]
    caught = sum(PiiKind.SECRET in kinds(f"key={t}") for t in tokens)
    assert caught / len(tokens) >= 0.97


def test_adversarial_input_stays_fast() -> None:
    import time

    texts = ["a@" * 20000, "1." * 20000, ":" * 40000, "1 " * 20000, "A1b2" * 10000, "a at " * 8000,
             "a dot " * 8000, "４" * 20000, "x 2025-06-01 " * 3000, "x 1234567 " * 4000, "a\u200b" * 20000,
             "12 34 " * 7000, "-265 -24 " * 4000]
    start = time.perf_counter()
    for text in texts:
        scan(text)
    assert time.perf_counter() - start < 10.0  # catastrophic backtracking takes minutes; 0.8 s on a Zen 3

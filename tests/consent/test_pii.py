"""PII and secret detectors: what each one must find, and what it must leave alone."""

import random
import string

import pytest

from specloop.consent.pii import PiiKind, luhn_valid, scan


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
    ],
)
def test_leaves_alone(text: str) -> None:
    assert kinds(text) == set()


def test_luhn() -> None:
    assert luhn_valid("4111111111111111")
    assert luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112")
    assert not luhn_valid("79927398710")


def test_spans_point_at_the_match() -> None:
    text = "a: bob@example.org, b: 10.1.2.3"
    spans = [(f.kind, text[f.start : f.end]) for f in scan(text)]
    assert spans == [(PiiKind.EMAIL, "bob@example.org"), (PiiKind.IPV4, "10.1.2.3")]


def test_random_tokens_caught_identifiers_not() -> None:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits
    tokens = ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(500)]
    caught = sum(PiiKind.SECRET in kinds(f"key={t}") for t in tokens)
    assert caught / len(tokens) >= 0.97


def test_adversarial_input_stays_fast() -> None:
    import time

    texts = ["a@" * 20000, "1." * 20000, ":" * 40000, "1 " * 20000, "A1b2" * 10000]
    start = time.perf_counter()
    for text in texts:
        scan(text)
    assert time.perf_counter() - start < 2.0

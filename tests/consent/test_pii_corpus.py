"""The PII screen against benchmarks/pii_corpus.py: obfuscated personal data caught, ordinary code
and prose let through, at the thresholds docs/data-governance.md states. Seed 0 is the draw the
detectors were tuned on; seed 1 is a fresh draw of values and sentences written the same ways."""

import pytest

from benchmarks.pii_corpus import corpus
from specloop.consent.pii import scan

MIN_RECALL = 0.99
MAX_FALSE_POSITIVES = 0.01


@pytest.fixture(scope="module")
def samples() -> tuple[list, list]:
    tuned, negatives = corpus(0)
    return tuned + corpus(1)[0], negatives


def test_recall_on_obfuscated_personal_data(samples: tuple[list, list]) -> None:
    positives, _ = samples
    missed = [s for s in positives if s.kind not in {f.kind for f in scan(s.text)}]
    assert len(positives) >= 1000
    assert 1 - len(missed) / len(positives) >= MIN_RECALL, [(s.variant, s.text) for s in missed[:10]]


def test_false_positives_on_code_and_prose(samples: tuple[list, list]) -> None:
    _, negatives = samples
    flagged = [s for s in negatives if scan(s.text)]
    assert len(negatives) >= 500
    assert len(flagged) / len(negatives) <= MAX_FALSE_POSITIVES, [(s.variant, s.text[:200]) for s in flagged[:5]]


def test_every_way_of_writing_is_in_the_corpus(samples: tuple[list, list]) -> None:
    """The recall figure covers each obfuscation the docs name, not only the easy ones."""
    variants = {s.variant for s in samples[0]}
    for written in ("full-width digits", "arabic-indic digits", "devanagari digits", "zero-width space",
                    "at/dot words", "[at]/[dot]", "unicode", "full-width at", "doubled separators",
                    "mixed separators", "unicode dashes"):
        assert any(written in v for v in variants), written

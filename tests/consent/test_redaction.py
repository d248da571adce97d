"""PII mode strip on token ids: what the detectors found leaves the ids, the rest stays as generated."""

import pytest

from specloop.consent.pii import scan
from specloop.consent.redaction import PLACEHOLDER, strip
from specloop.engine.loaders.load import LoadedModel


class CharTokens:
    """A tokenizer of `width` characters per token (ids index a table), for exact offsets."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for i in range(0, len(text), self.width):
            self.pieces.append(text[i:i + self.width])
            ids.append(len(self.pieces) - 1)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("width", [1, 3, 7])
def test_prompt_findings_become_the_placeholder_and_the_response_is_cut(width: int) -> None:
    tok = CharTokens(width)
    prompt = tok.encode("write to alice at example dot com, then call +1 415 555 0132 today")
    response = tok.encode("Done: I wrote. Next I call 415-555-0132 as asked.")
    out = strip(prompt, response, tok.decode, tok.encode)
    assert out is not None and (out.prompt_findings, out.response_findings) == (2, 1)
    text = tok.decode(out.prompt_ids)
    assert "alice" not in text and "415" not in text and text.count(PLACEHOLDER) == 2
    assert text.startswith("write t") and text.endswith("day")  # whole tokens go, nothing more
    assert out.response_ids == response[:len(out.response_ids)]  # a prefix: what the target generated
    assert tok.decode(out.response_ids).startswith("Done: I wrote. Next I ca"[:max(1, 24 - 2 * width)])
    assert "415" not in tok.decode(out.response_ids)


def test_a_clean_trace_is_kept_as_is() -> None:
    tok = CharTokens(4)
    prompt, response = tok.encode("sum the list [1, 2, 3]"), tok.encode("def f(xs): return sum(xs)")
    out = strip(prompt, response, tok.decode, tok.encode)
    assert out is not None and (out.prompt_ids, out.response_ids) == (prompt, response)


def test_a_response_that_starts_with_pii_leaves_nothing() -> None:
    tok = CharTokens(2)
    assert strip(tok.encode("my address?"), tok.encode("bob@example.org is yours"), tok.decode, tok.encode) is None


def test_ids_that_still_spell_a_finding_are_dropped() -> None:
    """Whatever the tokenizer does (here its placeholder decodes to an address), stripped ids are
    scanned again and a trace that still holds a finding is dropped, not kept."""
    tok = CharTokens(1)
    prompt, response = tok.encode("write to bob@example.org"), tok.encode("ok")
    spelled = tok.encode("eve@example.net")
    assert strip(prompt, response, tok.decode, lambda text: spelled) is None
    assert strip(prompt, response, tok.decode, tok.encode) is not None


def test_smollm2_ids_keep_nothing_the_detectors_found(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    chat = [{"role": "user", "content": "Mail ali\u200bce at example dot com, card ４１１１ １１１１ １１１１ １１１１, "
                                        "IBAN GB82 WEST 1234 5698 7654 32; what next?"}]
    prompt = tok.encode(tok.apply_chat_template(chat))
    response = tok.encode("First, write to bob＠example.org with the IBAN. Then wait.")
    out = strip(prompt, response, tok.decode, tok.encode)
    assert out is not None and (out.prompt_findings, out.response_findings) == (3, 1)
    for ids in (out.prompt_ids, out.response_ids):
        text = tok.decode(ids)
        assert scan(text) == [] and "example" not in text and "1234" not in text
    assert tok.decode(out.prompt_ids).endswith("what next?\nassistant\n")
    assert out.response_ids == response[:len(out.response_ids)] and tok.decode(out.response_ids) == "First, write to"

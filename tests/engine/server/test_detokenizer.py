"""Incremental detokenization and stop-string hold-back, with a real byte-level BPE tokenizer."""

import itertools

import pytest

from specloop.engine.loaders.load import LoadedModel
from specloop.engine.server.detokenizer import Detokenizer, StopStringMatcher

TEXTS = ["plain ascii words", "héllo wörld ñ", "emoji 🙂🚀 and 世界 mixed", "  spaces\n\nnewlines\t", "🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up(tiny_loaded: LoadedModel, text: str) -> None:
    tok = tiny_loaded.tokenizer
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    detok = Detokenizer(tok, prompt)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_character_split_across_tokens_waits_for_its_last_byte(tiny_loaded: LoadedModel) -> None:
    tok = tiny_loaded.tokenizer
    ids = tok.encode("🚀")
    assert len(ids) > 1, "the emoji is several byte tokens in this vocabulary"
    detok = Detokenizer(tok, [])
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_special_tokens_are_not_rendered(tiny_loaded: LoadedModel) -> None:
    tok = tiny_loaded.tokenizer
    detok = Detokenizer(tok, [])
    assert detok.push(tok.encode("done")) == "done"
    assert detok.push(list(tok.eos_token_ids)) == ""


def _stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = ""
    for p in pieces:
        out += m.push(p)
        if m.stopped:
            return out, True
    return out + m.flush(), False


@pytest.mark.parametrize("text, stops, expected, stopped", [
    ("hello world", ["wor"], "hello ", True),
    ("hello world", ["xyz"], "hello world", False),
    ("aaab", ["aab"], "a", True),
    ("one. two. three", [". t", "two"], "one", True),
    ("abc", ["c", "abc"], "", True),  # the earliest match wins
    ("ends with a partial sto", ["stop"], "ends with a partial sto", False),
])
def test_stop_strings_under_every_split(text: str, stops: list[str], expected: str, stopped: bool) -> None:
    for cut1, cut2 in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[:cut1], text[cut1:cut2], text[cut2:]]
        assert _stream(stops, pieces) == (expected, stopped), pieces


def test_a_possible_stop_prefix_is_held_back_until_decided() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.push("result </e") == "result "
    assert m.push("lsewhere") == "</elsewhere"
    assert m.push(" </en") == " "
    assert m.push("d> tail") == "" and m.stopped


def test_no_stop_strings_pass_everything_through() -> None:
    m = StopStringMatcher([])
    assert m.push("abc") == "abc" and m.flush() == ""

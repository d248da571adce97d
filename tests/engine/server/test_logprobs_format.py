"""`EmittedLogprobs`: a token's entry goes out only once all of its text has been sent, and tokens
past the text (a stop string's) never do."""

from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.logprobs import TokenLogprob
from specloop.engine.server.logprobs_format import EmittedLogprobs, completion_logprobs, token_text


def test_entries_follow_the_text_sent(tiny_loaded: LoadedModel) -> None:
    tok = tiny_loaded.tokenizer
    ids = tok.encode("hello world and more")
    texts = [token_text(tok, i) for i in ids]
    cursor = EmittedLogprobs(tok, [])
    cursor.push([TokenLogprob(i, -1.0, ()) for i in ids])
    assert cursor.take(len(texts[0]) - 1) == []  # the first token's text is not all out yet
    first = cursor.take(len(texts[0]) + len(texts[1]))
    assert [(offset, e.token_id) for offset, e in first] == [(0, ids[0]), (len(texts[0]), ids[1])]
    rest = cursor.take(len("".join(texts[:-1])))  # a stop string cut the last token's text
    assert [e.token_id for _, e in rest] == ids[2:-1] and cursor.take(len("".join(texts[:-1]))) == []


def test_the_legacy_format_marks_an_unscored_first_token(tiny_loaded: LoadedModel) -> None:
    tok = tiny_loaded.tokenizer
    a, b = tok.encode("hi there")[:2]
    out = completion_logprobs(tok, [(0, None, a), (2, TokenLogprob(b, -0.5, ((b, -0.5),)), b)])
    assert out.token_logprobs == [None, -0.5] and out.top_logprobs[0] is None
    assert out.top_logprobs[1] == {token_text(tok, b): -0.5} and out.text_offset == [0, 2]

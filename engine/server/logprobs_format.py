"""Log-probabilities in OpenAI's two wire formats, and which of them go with which text.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`. Completions: the legacy
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, which with `echo`
starts with the prompt's tokens (the first has none). A token's string is its own decoding, and
`bytes` that string's UTF-8: a token holding part of a character decodes to U+FFFD, as in vLLM.

Text reaches the client in pieces held back at incomplete characters and possible stop strings
(`serving.py`), so `EmittedLogprobs` hands out a token's entry only once all of its text has been
sent: entries and text stay aligned chunk by chunk, and tokens past a stop string are never
reported. The values themselves come from the engine (`engine/runtime/logprobs.py`).
"""

from collections import deque
from collections.abc import Sequence

from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.runtime.logprobs import TokenLogprob
from specloop.engine.server.detokenizer import Detokenizer
from specloop.engine.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class EmittedLogprobs:
    """The entries of tokens whose text lies within the first `emitted` characters, in order."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._detok = Detokenizer(tokenizer, prompt_ids)
        self._pending: deque[tuple[int, int, TokenLogprob]] = deque()  # (text start, text end, entry)
        self._length = 0

    def push(self, entries: Sequence[TokenLogprob]) -> None:
        for entry in entries:
            start = self._length
            self._length += len(self._detok.push([entry.token_id]))
            self._pending.append((start, self._length, entry))

    def take(self, emitted: int) -> list[tuple[int, TokenLogprob]]:
        """(text offset, entry) of each token now wholly sent, `emitted` characters having been sent."""
        taken = []
        while self._pending and self._pending[0][1] <= emitted:
            start, _, entry = self._pending.popleft()
            taken.append((start, entry))
        return taken


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(tokenizer: Tokenizer, entry: TokenLogprob) -> list[TopLogprob]:
    return [TopLogprob(token=(t := token_text(tokenizer, i)), logprob=lp, bytes=list(t.encode())) for i, lp in entry.top]


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        content.append(ChatTokenLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode()),
                                        top_logprobs=_top(tokenizer, entry)))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[tuple[int, TokenLogprob | None, int]]
                        ) -> CompletionLogprobs:
    """entries: (text offset, entry or None for a prompt's first token, token id)."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for offset, entry, token_id in entries:
        out.tokens.append(token_text(tokenizer, token_id))
        out.token_logprobs.append(None if entry is None else entry.logprob)
        out.top_logprobs.append(None if entry is None else {token_text(tokenizer, i): lp for i, lp in entry.top})
        out.text_offset.append(offset)
    return out


def prompt_entries(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                   scored: Sequence[TokenLogprob | None]) -> tuple[str, list[tuple[int, TokenLogprob | None, int]]]:
    """The prompt's text as echoed, and (offset, entry, id) of each prompt token."""
    detok = Detokenizer(tokenizer, [])
    text, entries = "", []
    for token_id, entry in zip(prompt_ids, scored, strict=True):
        entries.append((len(text), entry, token_id))
        text += detok.push([token_id])
    return text, entries

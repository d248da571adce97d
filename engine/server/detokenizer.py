"""Token ids to streamed text: incremental detokenization and stop-string matching.

`Detokenizer` turns a growing list of token ids into text pieces that are always whole characters:
byte-level BPE splits multi-byte characters across tokens, and a piece is held until the bytes
that finish its character arrive (decoding a partial character yields U+FFFD).

`StopStringMatcher` holds back any tail of the text that could still become a stop string, so a
stop string is never partially streamed and never appears in the output.

Neither knows about the engine or HTTP; both are fed text by `serving.py`.
"""

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded in front of the first output token, so that tokenizers which render a
# token's leading space only after another token (SentencePiece's "▁") keep it.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    """Incremental decoder for one sequence. `push` returns the text the new ids complete."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] were already emitted and are decoded again only as context;
        # ids[read:] are pending.
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, new_ids: Sequence[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]


class StopStringMatcher:
    """Cuts the text at the first stop string. `push` returns what is safe to stream now."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "stop strings are validated non-empty at the API edge"
        self._stops = tuple(stops)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add newly decoded text; return the part that can no longer turn into a stop string."""
        assert not self.stopped
        self._text += piece
        # A match cannot start before `_emitted`: any such start would have been a held-back tail.
        hits = [i for i in (self._text.find(s, self._emitted) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(self._text) - self._partial_tail())

    def flush(self) -> str:
        """The generation ended without a stop string: release whatever was held back."""
        return "" if self.stopped else self._take(len(self._text))

    def _take(self, end: int) -> str:
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def _partial_tail(self) -> int:
        """Length of the longest unemitted tail that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=0)
        for n in range(min(len(self._text) - self._emitted, longest - 1), 0, -1):
            tail = self._text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

"""Text to token ids and back, and the chat template, exactly as the served model expects them.

A thin wrapper over a `tokenizers.Tokenizer` (built by a loader from `tokenizer.json` or from GGUF
metadata) plus a chat template rendered with jinja2 the way transformers renders it: a sandboxed
environment with `trim_blocks`/`lstrip_blocks`, a `tojson` filter that does not escape HTML,
`raise_exception`, `strftime_now`, and the special tokens (`bos_token`, `eos_token`, ...) in the
context. Prompts therefore come out byte-identical to transformers' `apply_chat_template`.

This file reads no files and knows nothing about models, sampling or incremental detokenization.
"""

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment equivalent to transformers'."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode, decode and render chats for one model. Immutable after construction; thread-safe."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None,
                 special_tokens: Mapping[str, str], eos_token_ids: tuple[int, ...]) -> None:
        """`special_tokens` maps template names (`bos_token`, `eos_token`, `pad_token`, `unk_token`) to text."""
        if not eos_token_ids:
            raise ValueError("tokenizer: no end-of-sequence token id (eos_token_id) is defined")
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = eos_token_ids
        self._template = compile_chat_template(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` to prompt text; a template's `raise_exception` becomes a `ValueError`."""
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions endpoint")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: chat template refused them: {e}") from e

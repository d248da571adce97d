"""Request limits: how big an input may be, checked before any work is done with it.

Each limit is a `specloop serve` setting (`engine/server/settings.py`; docs/api.md, "Limits") and is
checked at the cheapest point that knows enough: the body's size as it arrives (`edge.py`), the stop
strings as the body is validated (`protocol.py`), the prompt's characters before it is tokenized or
templated, a JSON schema's size and depth before it is compiled (`api.py`), `n × max_tokens` before
the request is admitted (`admission.py`). What one sequence may cost is bounded by the context
length; these bound what one request can make the server do before that.

Not here: how many requests may run or wait (`admission.py`), the tenants' own limits
(`consent/tenants.py`).
"""

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int
    max_prompt_chars: int
    max_request_tokens: int  # n × max_tokens of one request
    max_schema_bytes: int
    max_schema_depth: int
    max_waiting: int  # sequences waiting for a KV-cache slot, all tenants together
    send_timeout_s: float  # a stream's client must take each chunk within this

    def __post_init__(self) -> None:
        assert min(self.max_body_bytes, self.max_prompt_chars, self.max_request_tokens, self.max_schema_bytes,
                   self.max_schema_depth) > 0 and self.max_waiting >= 0 and self.send_timeout_s > 0, self

    def check_prompt_chars(self, chars: int, field: str) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(f"{field}: the prompt has {chars} characters; this server takes at most "
                             f"{self.max_prompt_chars} (SPECLOOP_MAX_PROMPT_CHARS)")

    def check_schema(self, schema: dict[str, Any]) -> None:
        """ValueError unless the schema is within size and depth (before anything compiles it)."""
        if json_depth(schema, self.max_schema_depth) > self.max_schema_depth:
            raise ValueError(f"the JSON schema nests deeper than {self.max_schema_depth} levels "
                             f"(SPECLOOP_MAX_SCHEMA_DEPTH)")
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > self.max_schema_bytes:
            raise ValueError(f"the JSON schema has {size} bytes; this server takes at most {self.max_schema_bytes} "
                             f"(SPECLOOP_MAX_SCHEMA_BYTES)")


def json_depth(value: Any, stop_past: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` 1), counted without recursion and no
    further than `stop_past` + 1: a hostile document is deep by design."""
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= stop_past:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest

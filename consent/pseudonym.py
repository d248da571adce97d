"""Subject pseudonyms: a keyed HMAC-SHA256 of (tenant, user id).

The raw user id never leaves this module: callers get a 64-hex-digit pseudonym that is stable for
one key, differs across tenants for the same user id, and cannot be reversed or recomputed without
the key. This module is not key management; the key comes from `specloop.consent.settings`.
"""

import hashlib
import hmac
import json
import re

MIN_KEY_BYTES = 32
_PSEUDONYM = re.compile(r"[0-9a-f]{64}")


def is_pseudonym(value: str) -> bool:
    """True when `value` has the shape of a subject pseudonym (64 lowercase hex digits)."""
    return _PSEUDONYM.fullmatch(value) is not None


class Pseudonymizer:
    """Maps (tenant, user id) to a subject pseudonym under one secret key. Thread-safe."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"hmac_key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def subject(self, tenant: str, user: str) -> str:
        """The pseudonym of `user` within `tenant`.

        The pair is JSON-encoded so that ("a", "bc") and ("ab", "c") cannot collide; with
        ASCII escaping, lone surrogates (legal in a JSON `user` field) hash instead of raising.
        """
        mac = self._base.copy()
        mac.update(json.dumps([tenant, user], ensure_ascii=True).encode("ascii"))
        return mac.hexdigest()

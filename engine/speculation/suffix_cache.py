"""The suffix cache: each tenant's recent prompts and responses as token arrays, searchable for the
longest match of a sequence's last tokens and for what followed it.

One `TokenHistory` per namespace (a tenant): never shared between tenants, since how fast a draft
is accepted would tell one tenant what another sent. Documents (one request's prompt + response)
are appended to a flat int32 array, separated by -1, which no query token matches, so a match or a
continuation never runs from one document into another. Memory is bounded for all namespaces
together (`max_tokens`): the oldest document of any tenant is evicted first (FIFO, as vLLM's
suffix decoding evicts its oldest cached requests).

The index: for each anchor length m (`ANCHORS`), the hash of every m-gram inside a document, with
the position of its last token, kept in sorted runs (a log-structured merge: a run is merged into
the one before it when it has grown to a quarter of its size, so an append costs O(log N) amortized
and a lookup is one binary search per run, at most about log4(N / TAIL) + 1 runs). A lookup takes
the most recent `max_candidates` occurrences of the query's last m tokens, longest anchor first,
and measures how far back each occurrence matches (up to `max_match` tokens); the walk over what
followed the longest matches is `engine/speculation/suffix.py`'s.

Memory per cached token: 4 bytes of tokens plus, per anchor, 8 (hash) + 8 (position) bytes, plus
the growth slack of the arrays; `nbytes` counts it. Streaming 100k responses of 300 tokens (8
tenants) through a 4M-position cache: 269 MB held at the end, the process grown by 403 MB at most
(merges copy a run), 0.3 ms per response added (benchmarks/suffix_decoding.py, Zen 3).
Not here: deciding what to draft (`engine/speculation/suffix.py`).
"""

from collections import deque
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1
ANCHORS = (8, 2)  # anchor lengths, longest first; the last is the shortest match the cache reports
TAIL = 4096  # index entries kept unsorted (scanned linearly) before they become a sorted run
_PRIME = np.uint64(0x100000001B3)
_P, _MASK = int(_PRIME), (1 << 64) - 1


def hash_windows(tokens: np.ndarray, m: int) -> np.ndarray:
    """The hash of every window of m tokens `[len − m + 1]` (int64; equal windows, equal hashes)."""
    assert tokens.ndim == 1 and len(tokens) >= m
    windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), m)  # [n, m]
    powers = _PRIME ** np.arange(m - 1, -1, -1, dtype=np.uint64)  # wraps mod 2^64, on purpose
    with np.errstate(over="ignore"):
        return (windows * powers).sum(axis=1, dtype=np.uint64).view(np.int64)


def hash_last(tokens: np.ndarray, m: int) -> int:
    """`hash_windows(tokens, m)[-1]`, the hash of the last m tokens, in Python integers: a query hashes
    one window per lookup, where the vectorised form's set-up took 45 us (Zen 3)."""
    assert tokens.ndim == 1 and len(tokens) >= m
    h = 0
    for t in tokens[-m:].tolist():
        h = (h * _P + t) & _MASK  # as uint64 arithmetic, wrapping; a negative token as its two's complement
    return h - (1 << 64) if h >> 63 else h  # the int64 view


class _Runs:
    """Sorted runs of (hash, position) for one anchor length, plus an unsorted tail."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []  # (keys, positions), each sorted by key then position
        self.tail_keys: list[np.ndarray] = []
        self.tail_pos: list[np.ndarray] = []
        self.tail_size = 0

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        self.tail_keys.append(keys)
        self.tail_pos.append(positions)
        self.tail_size += len(keys)
        if self.tail_size >= TAIL:
            self._seal()

    def _seal(self) -> None:
        keys, pos = np.concatenate(self.tail_keys), np.concatenate(self.tail_pos)
        order = np.argsort(keys, kind="stable")  # positions ascend within a key: they were appended in order
        self.runs.append((keys[order], pos[order]))
        self.tail_keys, self.tail_pos, self.tail_size = [], [], 0
        while len(self.runs) >= 2 and 4 * len(self.runs[-1][0]) >= len(self.runs[-2][0]):
            (k1, p1), (k2, p2) = self.runs[-2], self.runs.pop()
            keys, pos = np.concatenate([k1, k2]), np.concatenate([p1, p2])
            order = np.argsort(keys, kind="stable")  # two sorted runs: timsort merges them in linear time
            self.runs[-1] = (keys[order], pos[order])

    def find(self, key: int) -> np.ndarray:
        """Every position indexed under `key`, ascending."""
        found = [p[np.searchsorted(k, key, "left"):np.searchsorted(k, key, "right")] for k, p in self.runs]
        if self.tail_size:
            keys, pos = np.concatenate(self.tail_keys), np.concatenate(self.tail_pos)
            self.tail_keys, self.tail_pos = [keys], [pos]
            found.append(pos[keys == key])
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def shift(self, start: int) -> None:
        """Drop positions below `start` and renumber the rest from zero (after the tokens were cut)."""
        self.runs = [(k[p >= start], p[p >= start] - start) for k, p in self.runs]
        self.runs = [r for r in self.runs if len(r[0])]
        self.tail_keys = [k[p >= start] for k, p in zip(self.tail_keys, self.tail_pos, strict=True)]
        self.tail_pos = [p[p >= start] - start for p in self.tail_pos]
        self.tail_size = sum(len(k) for k in self.tail_keys)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + p.nbytes for k, p in self.runs) + self.tail_size * 16


@dataclass(frozen=True)
class Match:
    """Occurrences of a query's suffix in a token array: `ends` `[c]` the positions of each occurrence's
    last token (most recent last), all matching the query's last `length` tokens."""

    tokens: np.ndarray
    ends: np.ndarray
    length: int


def longest_matches(tokens: np.ndarray, ends: np.ndarray, query: np.ndarray, max_match: int,
                    floor: int = 0) -> Match | None:
    """Of the candidate `ends` (positions whose token equals the query's last), those whose match with
    the query, read backwards, is longest (at most `max_match`; tokens before `floor` never match)."""
    if not len(ends):
        return None
    depth = min(max_match, len(query))
    offsets = np.arange(depth)  # [D]
    idx = ends[:, None] - offsets[None, :]  # [c, D]
    valid = idx >= floor
    seen = tokens[np.maximum(idx, 0)]
    same = valid & (seen == query[::-1][None, :depth])  # [c, D]
    lengths = same.cumprod(axis=1).sum(axis=1)  # [c]
    best = int(lengths.max())
    if best == 0:
        return None
    return Match(tokens, ends[lengths == best], best)


class TokenHistory:
    """One namespace's documents and their anchor index."""

    def __init__(self) -> None:
        self.tokens = np.empty(1024, dtype=np.int32)
        self.size = 0  # tokens written, separators included
        self.start = 0  # positions before it are evicted
        self.index = {m: _Runs() for m in ANCHORS}

    def append(self, doc: np.ndarray) -> int:
        """Append a document; returns how many positions it took (its tokens and a separator)."""
        if self.size + len(doc) + 1 > len(self.tokens):
            self._renumber(np.empty(2 * (self.live + len(doc) + 1), dtype=np.int32))
        at = self.size
        self.tokens[at:at + len(doc)] = doc
        self.tokens[at + len(doc)] = SEPARATOR
        self.size = at + len(doc) + 1
        for m, runs in self.index.items():
            if len(doc) >= m:
                runs.add(hash_windows(doc, m), np.arange(at + m - 1, at + len(doc), dtype=np.int64))
        return len(doc) + 1

    def evict(self, positions: int) -> None:
        """Forget the oldest `positions` (whole documents, as `append` counted them)."""
        self.start += positions
        assert self.start <= self.size
        if self.start > (self.size - self.start):  # compact once the dead prefix outweighs what lives
            self._renumber(np.empty(max(1024, 2 * (self.size - self.start)), dtype=np.int32))

    def _renumber(self, into: np.ndarray) -> None:
        live = self.size - self.start
        into[:live] = self.tokens[self.start:self.size]
        for runs in self.index.values():
            runs.shift(self.start)
        self.tokens, self.size, self.start = into, live, 0

    @property
    def live(self) -> int:
        return self.size - self.start

    def lookup(self, query: np.ndarray, max_match: int, max_candidates: int) -> Match | None:
        """The longest matches of `query`'s suffix, among the most recent occurrences of its anchors."""
        view = self.tokens[:self.size]
        for m in ANCHORS:
            if len(query) < m:
                continue
            ends = self.index[m].find(hash_last(query, m))
            ends = ends[ends >= self.start + m - 1][-max_candidates:]
            match = longest_matches(view, ends, query, max_match, self.start)
            if match is not None and match.length >= m:  # below m: a hash collision, not a match
                return match
        return None

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(r.nbytes for r in self.index.values())


class SuffixCache:
    """Every namespace's `TokenHistory`, bounded to `max_tokens` cached positions in all. Not thread-safe:
    the engine thread owns it."""

    def __init__(self, max_tokens: int = 2_000_000, max_document: int = 8192) -> None:
        if max_tokens < 1 or max_document < 1:
            raise ValueError(f"max_tokens and max_document must be >= 1, got {max_tokens}, {max_document}")
        self.max_tokens, self.max_document = max_tokens, min(max_document, max_tokens - 1)
        self.histories: dict[str, TokenHistory] = {}
        self._order: deque[tuple[str, int]] = deque()  # (namespace, positions), oldest first
        self.size = 0

    def add(self, namespace: str, tokens: list[int]) -> None:
        """Remember one document (a request's prompt and response) for `namespace`; the oldest documents
        of any namespace go when the cache is full. Longer documents keep their last `max_document`."""
        doc = np.asarray(tokens[-self.max_document:], dtype=np.int32)
        if not len(doc):
            return
        history = self.histories.setdefault(namespace, TokenHistory())
        used = history.append(doc)
        self._order.append((namespace, used))
        self.size += used
        while self.size > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        namespace, used = self._order.popleft()
        history = self.histories[namespace]
        history.evict(used)
        self.size -= used
        if history.live == 0:
            del self.histories[namespace]

    def lookup(self, namespace: str, query: np.ndarray, max_match: int, max_candidates: int) -> Match | None:
        history = self.histories.get(namespace)
        return history.lookup(query, max_match, max_candidates) if history else None

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.histories.values())

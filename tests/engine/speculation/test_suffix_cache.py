"""The suffix cache against a brute-force search: longest matches, namespaces kept apart, FIFO eviction
under a token budget, and the index staying right across merges and compactions."""

import numpy as np
import pytest

from specloop.engine.speculation import suffix_cache
from specloop.engine.speculation.suffix_cache import SuffixCache, TokenHistory, hash_last, hash_windows


def brute_longest(docs: list[list[int]], query: list[int], max_match: int) -> tuple[int, set[int]]:
    """Longest match of the query's suffix in any document, and the tokens that followed each."""
    best, follows = 0, set()
    for doc in docs:
        for end in range(len(doc)):
            n = 0
            while n < min(max_match, len(query), end + 1) and doc[end - n] == query[-1 - n]:
                n += 1
            if n > best:
                best, follows = n, set()
            if n == best and n and end + 1 < len(doc):
                follows.add(doc[end + 1])
    return best, follows


def random_docs(rng: np.random.Generator, count: int, vocab: int = 6) -> list[list[int]]:
    return [rng.integers(0, vocab, int(rng.integers(1, 60))).tolist() for _ in range(count)]


def test_hash_windows_equal_windows_equal_hashes() -> None:
    h = hash_windows(np.array([1, 2, 3, 1, 2, 3, 4]), 3)
    assert h[0] == h[3] and len(set(h.tolist())) == 4


@pytest.mark.parametrize("m", [1, 2, 8])
def test_hash_last_is_the_last_window_hash(m: int) -> None:
    tokens = np.random.default_rng(m).integers(-1, 49152, 40).astype(np.int32)  # -1: a separator
    assert hash_last(tokens, m) == int(hash_windows(tokens, m)[-1])


@pytest.mark.parametrize("seed", range(4))
def test_lookup_finds_the_longest_match_across_merged_runs(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    monkeypatch.setattr(suffix_cache, "TAIL", 64)  # many sorted runs and merges on a small history
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 120)
    history = TokenHistory()
    for doc in docs:
        history.append(np.asarray(doc, dtype=np.int32))
    assert len(history.index[2].runs) >= 2
    for _ in range(50):
        query = rng.integers(0, 6, 12).tolist()
        best, follows = brute_longest(docs, query, 10)
        match = history.lookup(np.asarray(query, dtype=np.int32), 10, max_candidates=10**6)
        if best < 2:
            assert match is None
            continue
        assert match is not None and match.length == best
        followed = {int(match.tokens[e + 1]) for e in match.ends} - {suffix_cache.SEPARATOR}
        assert followed == follows


def test_namespaces_never_see_each_other() -> None:
    cache = SuffixCache()
    cache.add("a", [1, 2, 3, 4, 5])
    q = np.array([9, 2, 3], dtype=np.int32)
    assert cache.lookup("a", q, 8, 8).length == 2
    assert cache.lookup("b", q, 8, 8) is None


def test_a_match_never_runs_across_documents() -> None:
    cache = SuffixCache()
    cache.add("a", [1, 2, 3])
    cache.add("a", [4, 5, 6])
    assert cache.lookup("a", np.array([3, 4], dtype=np.int32), 8, 8) is None
    assert cache.lookup("a", np.array([2, 3], dtype=np.int32), 8, 8).length == 2


def test_eviction_keeps_the_budget_and_forgets_the_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suffix_cache, "TAIL", 16)
    cache = SuffixCache(max_tokens=100)
    rng = np.random.default_rng(0)
    docs = [rng.integers(100 * i, 100 * i + 50, 9).tolist() for i in range(40)]  # disjoint vocabularies
    for i, doc in enumerate(docs):
        cache.add("ab"[i % 2], doc)
        assert cache.size <= 100
    # 10 positions per document: the last 10 documents live, each still found; older ones gone.
    for i, doc in enumerate(docs):
        match = cache.lookup("ab"[i % 2], np.asarray(doc[2:5], dtype=np.int32), 8, 8)
        assert (match is not None and match.length == 3) == (i >= 30), i
    assert sum(h.live for h in cache.histories.values()) == cache.size == 100


def test_a_namespace_whose_documents_are_all_evicted_is_dropped() -> None:
    cache = SuffixCache(max_tokens=10)
    cache.add("old", [1, 2, 3])
    cache.add("new", list(range(8)))
    assert set(cache.histories) == {"new"}


def test_long_documents_keep_their_end() -> None:
    cache = SuffixCache(max_tokens=1000, max_document=5)
    cache.add("a", list(range(20)))
    assert cache.size == 6
    assert cache.lookup("a", np.array([16, 17], dtype=np.int32), 8, 8).length == 2
    assert cache.lookup("a", np.array([3, 4], dtype=np.int32), 8, 8) is None


def test_memory_stays_bounded_while_documents_stream_through() -> None:
    cache = SuffixCache(max_tokens=20_000)
    rng = np.random.default_rng(1)
    peak = 0
    for _ in range(2000):
        cache.add("t", rng.integers(0, 49152, 100).tolist())
        peak = max(peak, cache.nbytes)
    # 4 bytes of tokens and 16 per anchor per position, at most doubled by growth slack.
    assert peak <= 2 * 20_000 * (4 + 16 * len(suffix_cache.ANCHORS))

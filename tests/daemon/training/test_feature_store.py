"""The feature store: memory budget, disk reuse across instances, keys, unreadable and unwritable files,
and the disk cap's least-recently-used eviction."""

import os
from pathlib import Path

import pytest
import torch

from specloop.daemon.training.feature_store import FeatureStore


def features(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 4, generator=g).to(torch.bfloat16), torch.randint(0, 50, (7,), generator=g)]


def test_memory_only_keeps_what_fits() -> None:
    store = FeatureStore("ns", memory_bytes=100)  # one sequence is 7·4·2 + 7·8 = 112 bytes
    assert store.can_store()
    store.put(store.key([1, 2, 3]), features(0))
    assert len(store) == 1 and not store.can_store()
    store.put(store.key([4, 5]), features(1))
    assert len(store) == 1 and store.get(store.key([4, 5])) is None


def test_keys_depend_on_namespace_and_every_token() -> None:
    a, b = FeatureStore("fp-a|bf16", 0), FeatureStore("fp-b|bf16", 0)
    assert a.key([1, 2, 3]) == a.key((1, 2, 3))
    assert len({a.key([1, 2, 3]), a.key([1, 2, 4]), a.key([1, 2]), b.key([1, 2, 3])}) == 4


def test_disk_is_read_by_a_later_store(tmp_path: Path) -> None:
    first = FeatureStore("ns", 0, tmp_path)
    first.put(first.key([1, 2, 3]), features(0))
    assert len(first) == 0  # no memory budget: disk only
    later = FeatureStore("ns", 1e6, tmp_path)
    got = later.get(later.key([1, 2, 3]))
    assert got is not None and later.disk_hits == 1
    for a, b in zip(got, features(0), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    other = FeatureStore("fp-other", 0, tmp_path)  # another base model, same directory and tokens
    assert other.get(other.key([1, 2, 3])) is None


def test_unreadable_file_is_a_miss_and_is_rewritten(tmp_path: Path) -> None:
    store = FeatureStore("ns", 0, tmp_path)
    key = store.key([9, 9])
    store.put(key, features(2))
    (tmp_path / f"{key}.safetensors").write_bytes(b"half a file")
    assert store.get(key) is None and store.misses == 1
    store.put(key, features(2))
    assert torch.equal(store.get(key)[1], features(2)[1])


def test_unwritable_directory_stops_writing_not_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FeatureStore("ns", 1e6, tmp_path)

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specloop.daemon.training.feature_store.save_file", full_disk)
    store.put(store.key([1]), features(0))
    assert not store.writable and len(store) == 1 and not list(tmp_path.iterdir())
    assert store.can_store()  # memory still has room


def test_negative_memory_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="memory_bytes"):
        FeatureStore("ns", -1)


def test_disk_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = FeatureStore("ns", 0, tmp_path / "probe")
    probe.put(probe.key([0]), features(0))
    size = probe.disk_used  # one sequence's file
    assert size == next((tmp_path / "probe").iterdir()).stat().st_size
    store = FeatureStore("ns", 0, tmp_path / "capped", disk_bytes=3.5 * size)
    keys = [store.key([i]) for i in range(4)]
    for t, key in enumerate(keys[:3]):
        store.put(key, features(0))
        os.utime(tmp_path / "capped" / f"{key}.safetensors", (1000 + t, 1000 + t))  # written in this order
    assert store.get(keys[0]) is not None  # read: now the most recently used
    store.put(keys[3], features(0))  # a fourth file passes the cap: the least recently used goes
    left = {f.stem for f in (tmp_path / "capped").iterdir()}
    assert left == {keys[0], keys[2], keys[3]} and store.evicted == 1 and store.disk_used == 3 * size
    assert FeatureStore("ns", 0, tmp_path / "capped", disk_bytes=size).disk_used == 3 * size  # counts what it finds


def test_disk_cap_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_bytes"):
        FeatureStore("ns", 0, tmp_path, disk_bytes=0)

"""The target's features of training sequences, kept in memory and, optionally, on disk across runs.

A drafter training step needs the frozen target's tapped hidden states (and, when distilling, its
greedy picks) for every sequence in its batch. On CPU that target pass is most of a step (SmolLM2
bf16, batch 4, 256 anchors, 1 drafter layer: 2.58 s per step computing it, 0.84 s reading it back
from this store's files), and a retrain sees most of its sequences again: a drafter refitted each
week on the accumulated traces would otherwise run the target over last week's traces every week.
Features depend only on the key below, so they are stored per sequence under it: in memory up to a
budget, and, given a directory, as one safetensors file per sequence that later runs read instead
of running the target.

Key: a digest of the namespace (base-model fingerprint, target dtype, tapped layers, whether greedy
picks are included) and the token ids. A file that cannot be read is a miss and is rewritten; a file
that cannot be written (a full disk) stops writing, never training.

The directory can be capped (`disk_bytes`): a weekly retrain adds a week of traces, and at 1.8 MB per
SmolLM2 answer in bf16 the 7,629 answers of one run already took 14 GB. Past the cap the least
recently used files go first (a read touches its file), so features of sequences no run asks for
any more, such as those of an older base model, leave before those of this run's data.

Not here: computing the features (`daemon/training/target_features.py`), what to train on.
"""

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

Features = list[torch.Tensor]  # one sequence's tensors, each with the sequence length first


class FeatureStore:
    """Per-sequence target features by key; `get` tries memory, then the directory."""

    def __init__(self, namespace: str, memory_bytes: float, directory: str | Path | None = None,
                 device: torch.device | str = "cpu", disk_bytes: float | None = None) -> None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
        if disk_bytes is not None and disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be > 0 (or None for no cap), got {disk_bytes}")
        self.namespace, self.memory_bytes, self.device = namespace, memory_bytes, torch.device(device)
        self.directory = Path(directory) if directory is not None else None
        self.writable = self.directory is not None
        self.disk_bytes = disk_bytes
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        # Listed only under a cap: an uncapped store has no use for the size, and start-up stays one mkdir.
        self.disk_used = sum(size for _, size, _ in self._file_stats()) if disk_bytes is not None else 0
        self.memory: dict[str, Features] = {}
        self.memory_used = 0
        self.disk_hits = self.misses = self.evicted = 0

    def __len__(self) -> int:
        return len(self.memory)

    def key(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(self.namespace.encode())
        h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
        return h.hexdigest()[:40]

    def can_store(self) -> bool:
        """Whether a newly computed sequence would be kept anywhere (else it is not worth a pass of its own)."""
        return self.writable or self.memory_used < self.memory_bytes

    def get(self, key: str) -> Features | None:
        if key in self.memory:
            return self.memory[key]
        loaded = self._read(key)
        if loaded is None:
            self.misses += 1
            return None
        self.disk_hits += 1
        self._remember(key, loaded)
        return loaded

    def _file_stats(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every feature file in the directory."""
        stats = []
        for f in self.directory.glob("*.safetensors") if self.directory is not None else []:
            try:
                st = f.stat()
            except FileNotFoundError:  # another run evicted it meanwhile
                continue
            stats.append((st.st_mtime, st.st_size, f))
        return stats

    def _evict(self) -> None:
        """Delete the least recently used files until the directory is 10% under its cap (so that
        not every write lists the directory)."""
        assert self.disk_bytes is not None
        files = self._file_stats()
        self.disk_used = sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if self.disk_used <= 0.9 * self.disk_bytes:
                break
            f.unlink(missing_ok=True)
            self.disk_used -= size
            self.evicted += 1

    def put(self, key: str, features: Features) -> None:
        self._remember(key, features)
        if self.writable and not (self.directory / f"{key}.safetensors").is_file():
            self._write(key, features)

    def _remember(self, key: str, features: Features) -> None:
        if self.memory_used < self.memory_bytes:
            self.memory[key] = features
            self.memory_used += sum(t.nbytes for t in features)

    def _read(self, key: str) -> Features | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.safetensors"
        if not path.is_file():
            return None
        try:
            tensors = load_file(path)
            os.utime(path)  # recently used: the cap evicts the least recently used first
        except FileNotFoundError:  # evicted by another run since is_file()
            return None
        except (OSError, SafetensorError) as e:
            log.warning("feature file %s is unreadable (%s); recomputing it", path, e)
            path.unlink(missing_ok=True)
            return None
        return [tensors[str(i)].to(self.device) for i in range(len(tensors))]

    def _write(self, key: str, features: Features) -> None:
        assert self.directory is not None
        path = self.directory / f"{key}.safetensors"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            save_file({str(i): t.detach().cpu().contiguous() for i, t in enumerate(features)}, tmp)
            tmp.replace(path)  # atomic: a reader never sees half a file
            self.disk_used += path.stat().st_size
        except OSError as e:
            log.warning("cannot write features to %s (%s); keeping them in memory only from now on", path, e)
            tmp.unlink(missing_ok=True)
            self.writable = False
            return
        if self.disk_bytes is not None and self.disk_used > self.disk_bytes:
            self._evict()

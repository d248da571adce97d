"""Where traces live on disk: hive directories, file names, durable writes and the live file list.

Layout under a root: `base_model=<fingerprint>/dt=<YYYY-MM-DD>/<file>.parquet`.

* A sink file is named `<topic>+<partition>+<first offset, 20 digits>.parquet`: a replay of the
  same Kafka batch rewrites the same name instead of adding a file.
* A compacted file is named `compacted-<digest of its sources>.parquet` and only ever holds rows
  whose offsets the sink has committed.
* A `_compaction-<digest>.json` manifest next to them records a merge in progress; `live_files`
  honours it, so a reader that lists files through this module never sees a row twice or misses
  one, whatever step a compaction crashed in.

Every write is temp file + fsync + rename + directory fsync. Dot-prefixed temp names never match
`*.parquet`, so a crashed writer leaves nothing a reader picks up. This module is not the sink,
the compactor or the reader; it holds the rules they share.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

_SINK_FILE = re.compile(r"(?P<topic>[A-Za-z0-9._-]+)\+(?P<partition>\d+)\+(?P<first>\d{20})\.parquet")
MANIFEST_GLOB = "_compaction-*.json"
LOCK_NAME = ".specloop.lock"


@dataclass(frozen=True, slots=True)
class SinkFile:
    """A file written by the sink, identified by the Kafka batch it came from."""

    path: Path
    topic: str
    partition: int
    first_offset: int


def hive_dir(root: Path, base_model: str, day: str) -> Path:
    return root / f"base_model={base_model}" / f"dt={day}"


def sink_file_name(topic: str, partition: int, first_offset: int) -> str:
    return f"{topic}+{partition}+{first_offset:020d}.parquet"


def parse_sink_file(path: Path) -> SinkFile | None:
    """The Kafka coordinates in a sink file's name, or None for any other file."""
    match = _SINK_FILE.fullmatch(path.name)
    if match is None:
        return None
    return SinkFile(path, match["topic"], int(match["partition"]), int(match["first"]))


def sink_files(root: Path, topic: str, partition: int) -> list[SinkFile]:
    """All sink files of one Kafka partition, in every hive directory."""
    found = (parse_sink_file(p) for p in root.glob(f"base_model=*/dt=*/{topic}+{partition}+*.parquet"))
    return [f for f in found if f is not None and f.topic == topic and f.partition == partition]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(target: Path, write: Callable[[Path], None]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(temp)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(target.parent)


def write_parquet_atomic(target: Path, table: pa.Table) -> None:
    """Write `table` to `target` so that it appears whole or not at all, and survives power loss."""
    _atomic_write(target, lambda temp: pq.write_table(table, temp, compression="zstd"))


def write_json_atomic(target: Path, document: dict) -> None:
    _atomic_write(target, lambda temp: temp.write_text(json.dumps(document, indent=2, sort_keys=True)))


def append_json_line(path: Path, document: dict) -> None:
    """Append `document` as one JSON line, durably: one O_APPEND write (concurrent appenders never
    interleave), fsynced, and the directory fsynced on creation. A short write (a full disk) is cut
    back and raises; a fragment a crash left (its writer never returned) is cut off first."""
    line = (json.dumps(document, sort_keys=True) + "\n").encode()
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # writers of one file (eraser, daemons) check and append in turn
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a crash cut an append short: it recorded nothing
            size = os.pread(fd, size, 0).rfind(b"\n") + 1
            os.ftruncate(fd, size)
        written = os.write(fd, line)
        if written != len(line):  # a full disk: leave no fragment for the next append to join
            os.ftruncate(fd, size)
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def read_json_lines(path: Path) -> list[dict]:
    """The documents `append_json_line` wrote; an unterminated last line (a crash mid-append, whose
    writer never returned) is left out."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def remove_durably(paths: list[Path]) -> None:
    """Unlink `paths` (missing ones are fine) and fsync their directories."""
    for path in paths:
        path.unlink(missing_ok=True)
    for directory in {path.parent for path in paths}:
        if directory.exists():
            fsync_dir(directory)


def pending_merges(directory: Path) -> Iterator[tuple[Path, Path, list[Path]]]:
    """(manifest, merged file, source files) of every compaction recorded in `directory`."""
    for manifest in sorted(directory.glob(MANIFEST_GLOB)):
        document = json.loads(manifest.read_text())
        sources = [directory / name for name in document["sources"]]
        yield manifest, directory / document["merged"], sources


def base_models(root: Path) -> list[str]:
    """The fingerprints that have a partition under `root`, sorted."""
    return sorted(p.name.removeprefix("base_model=") for p in root.glob("base_model=*") if p.is_dir())


def live_files(root: Path, base_model: str | None = None) -> list[Path]:
    """The Parquet files a reader should read: each row exactly once.

    A merge whose merged file exists supersedes its sources (they are about to be removed); a merge
    whose merged file does not exist yet has changed nothing.
    """
    pattern = f"base_model={base_model or '*'}/dt=*"
    files: list[Path] = []
    for directory in sorted(root.glob(pattern)):
        superseded = {
            source
            for _, merged, sources in pending_merges(directory)
            if merged.exists()
            for source in sources
        }
        files.extend(p for p in sorted(directory.glob("*.parquet")) if p not in superseded)
    return files


@contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """Hold the root's maintenance lock: compaction and erasure never run at the same time, nor
    while a sink writes (`shared`)."""
    with _locked(root, fcntl.LOCK_EX):
        yield


@contextmanager
def shared(root: Path) -> Iterator[None]:
    """Hold the root's lock shared, as the sink does from reading the erasure journal to writing its
    files: an erasure then either sees those files or is in the journal the sink read."""
    with _locked(root, fcntl.LOCK_SH):
        yield


@contextmanager
def _locked(root: Path, mode: int) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a+") as handle:
        fcntl.flock(handle.fileno(), mode)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

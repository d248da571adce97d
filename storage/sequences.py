"""Token sequences for drafter training and evaluation, read from Parquet or JSONL.

Each record has `prompt_token_ids` and `response_token_ids` (lists of ints: the prompt as the model
saw it, after the chat template, and the target's own answer). Loss and evaluation only ever look
at the response. Parquet inputs may be files or directories (e.g. the trace store's hive layout);
other columns are ignored. The digest identifies the exact token content, for drafter lineage.

It lives in storage because both the trainer (`daemon/training/`) and the evaluators
(`daemon/evaluation/`) read it, and the dataset builder's Parquet (`dataset.py`) is its main input.
This file does not build datasets (consent filtering, dedup: `dataset.py`) and knows no tokenizer.
"""

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.dataset as ds

COLUMNS = ("prompt_token_ids", "response_token_ids")


@dataclass(frozen=True)
class TokenSequence:
    prompt: tuple[int, ...]
    response: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt_token_ids must not be empty")

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + list(self.response)

    def key(self) -> bytes:
        return json.dumps([self.prompt, self.response], separators=(",", ":")).encode()


def _from_record(rec: dict, where: str) -> TokenSequence:
    for col in COLUMNS:
        if not isinstance(rec.get(col), list):
            raise ValueError(f"{where}: field {col!r} must be a list of token ids")
    return TokenSequence(tuple(int(t) for t in rec[COLUMNS[0]]), tuple(int(t) for t in rec[COLUMNS[1]]))


def _read_jsonl(path: Path) -> list[TokenSequence]:
    out = []
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                out.append(_from_record(json.loads(line), f"{path}:{i}"))
    return out


def _read_parquet(path: Path) -> list[TokenSequence]:
    if path.is_dir() and not any(path.rglob("*.parquet")):
        # `specloop generate --out DIR` writes DIR/train.jsonl beside DIR/heldout.jsonl: reading every
        # JSONL file of a directory would train on the held-out answers, so the files are named instead.
        jsonl = sorted(str(f) for f in path.glob("*.jsonl"))
        hint = f"; pass JSONL files one by one ({', '.join(jsonl)})" if jsonl else ""
        raise ValueError(f"{path} holds no Parquet files{hint}")
    dataset = ds.dataset(path, format="parquet", partitioning="hive")
    missing = [c for c in COLUMNS if c not in dataset.schema.names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}")
    table = dataset.to_table(columns=list(COLUMNS))
    return [_from_record(rec, str(path)) for rec in table.to_pylist()]


def read_sequences(paths: Iterable[str | Path]) -> list[TokenSequence]:
    """All sequences from JSONL files (`.jsonl`) and Parquet files or directories, in the order given."""
    out: list[TokenSequence] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"training data {p} does not exist")
        out.extend(_read_jsonl(p) if p.suffix == ".jsonl" else _read_parquet(p))
    return out


def write_jsonl(path: str | Path, sequences: Iterable[TokenSequence]) -> None:
    Path(path).write_text("")
    append_jsonl(path, sequences)


def append_jsonl(path: str | Path, sequences: Iterable[TokenSequence]) -> None:
    """Append records and fsync, so a run stopped later keeps them."""
    with Path(path).open("a") as f:
        for s in sequences:
            f.write(json.dumps({COLUMNS[0]: list(s.prompt), COLUMNS[1]: list(s.response)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def digest(sequences: Sequence[TokenSequence]) -> str:
    """sha256 over the token content, order included: the same data gives the same digest."""
    h = hashlib.sha256()
    for s in sequences:
        h.update(s.key())
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def split_heldout(sequences: Sequence[TokenSequence], fraction: float,
                  salt: str = "") -> tuple[list[TokenSequence], list[TokenSequence]]:
    """(train, held-out) by a hash of each sequence's prompt, so a prompt never lands on both sides.

    Splits with different `salt`s are independent: a split of an already-split side is not empty.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    train, held = [], []
    for s in sequences:
        key = (salt + json.dumps(s.prompt)).encode()
        bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
        (held if bucket < fraction else train).append(s)
    return train, held

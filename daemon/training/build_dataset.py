"""`specloop build-dataset`: the consented traces of one base model as a drafter-training dataset.

This command is where consent and storage meet for training data: it takes a snapshot of who
consents to the purpose from the consent registry (`consent/registry.py`) and hands it to storage's
DuckDB builder (`storage/dataset.py`), which joins traces against it. Neither package imports the
other. It holds no dataset logic of its own.
"""

import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("build-dataset")(build_dataset_command)


def build_dataset_command(
    root: Annotated[Path, typer.Option(help="Root directory of the trace Parquet files")],
    output: Annotated[Path, typer.Option(help="Directory for train/eval Parquet and manifest.json")],
    consent_db: Annotated[Path, typer.Option(help="The consent registry SQLite file")],
    base_model: Annotated[str, typer.Option(help="Base-model fingerprint to select")],
    since: Annotated[datetime | None, typer.Option(help="Earliest created_at (UTC)")] = None,
    until: Annotated[datetime | None, typer.Option(help="Latest created_at, exclusive (UTC)")] = None,
    limit: int | None = None,
    eval_fraction: float = 0.1,
    purpose: str = "drafter_training",
) -> None:
    """Build a drafter-training dataset from consented traces of one base model."""
    from specloop.consent.registry import ConsentRegistry
    from specloop.storage.dataset import build_dataset

    registry = ConsentRegistry(consent_db)
    try:
        snapshot = registry.snapshot(purpose)
    finally:
        registry.close()
    manifest = build_dataset(root, output, snapshot, base_model=base_model, since=_as_utc(since), until=_as_utc(until),
                         limit=limit, eval_fraction=eval_fraction)
    typer.echo(json.dumps(asdict(manifest), indent=2))


def _as_utc(at: datetime | None) -> datetime | None:
    """typer parses naive datetimes; the command line means UTC."""
    return at if at is None or at.tzinfo else at.replace(tzinfo=UTC)

"""The drafter artifact: a directory with `model.safetensors` and `drafter.json`.

`drafter.json` holds the architecture (`DFlashConfig`: layers, widths, heads, block size, mask
token or learned mask, tapped target layers, trimmed vocabulary size), the base-model fingerprint
the drafter was trained for, and its lineage (dataset digest, steps, seed, ...). The safetensors
file holds the drafter's own weights only (plus `vocab_ids` when the output vocabulary is
trimmed): the target's embedding and LM head are borrowed at serve time and never stored.

Loading checks the fingerprint: a drafter is only ever used with the model it was trained for.
This file does not train, serve or register drafters.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter

FORMAT = "specloop-dflash-drafter"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "drafter.json"


@dataclass(frozen=True)
class Lineage:
    """Where a drafter came from: enough to reproduce or audit the training run."""

    data_digest: str
    steps: int
    seed: int
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. tokens seen, held-out loss, warm start


@dataclass(frozen=True)
class DrafterArtifact:
    drafter: DFlashDrafter
    fingerprint: str
    lineage: Lineage
    path: Path


def save_drafter(path: str | Path, drafter: DFlashDrafter, fingerprint: str, lineage: Lineage) -> Path:
    """Write the artifact directory (created if missing; existing files are replaced)."""
    if not fingerprint:
        raise ValueError("fingerprint must be the base model's non-empty fingerprint")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, out / WEIGHTS, metadata={"format": FORMAT, "fingerprint": fingerprint})
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model_fingerprint": fingerprint,
        "config": drafter.config.to_json(),
        "lineage": {"data_digest": lineage.data_digest, "steps": lineage.steps, "seed": lineage.seed,
                    **lineage.extra},
    }
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_meta(path: str | Path) -> dict[str, Any]:
    """The parsed `drafter.json` of an artifact, checked for format and version."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"drafter artifact {path}: no {CONFIG}")
    meta = json.loads(file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"drafter artifact {path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"drafter artifact {path}: format_version {meta.get('format_version')} is not supported")
    return meta


def load_drafter(path: str | Path, expected_fingerprint: str | None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DrafterArtifact:
    """Load an artifact; refuse it when `expected_fingerprint` (the served model's) differs from its own.

    `expected_fingerprint=None` skips the check, for tools that only inspect an artifact.
    """
    meta = read_meta(path)
    fingerprint = meta["base_model_fingerprint"]
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise ValueError(
            f"drafter {path} was trained for base model {fingerprint}, but the served model is "
            f"{expected_fingerprint}; a drafter only works with the model it was trained for"
        )
    drafter = DFlashDrafter(DFlashConfig.from_json(meta["config"]))
    drafter.load_state_dict(load_file(Path(path) / WEIGHTS), strict=True)
    lin = dict(meta["lineage"])
    lineage = Lineage(data_digest=lin.pop("data_digest"), steps=lin.pop("steps"), seed=lin.pop("seed"), extra=lin)
    return DrafterArtifact(drafter.to(device=device, dtype=dtype), fingerprint, lineage, Path(path))

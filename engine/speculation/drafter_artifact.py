"""The drafter artifact: a directory with `model.safetensors` and `drafter.json`.

`drafter.json` holds the architecture (`DFlashConfig`: layers, widths, heads, block size, mask
token or learned mask, tapped target layers, trimmed vocabulary size), the base-model fingerprint
the drafter was trained for, and its lineage (dataset digest, steps, seed, ...). The safetensors
file holds the drafter's own weights only (plus `vocab_ids` when the output vocabulary is
trimmed): the target's embedding and LM head are borrowed at serve time and never stored.

Loading checks the fingerprint: a drafter is only ever used with the model it was trained for. An
artifact from a registry is untrusted input, so its files are bounded before they are read:
`drafter.json` by `MAX_CONFIG_BYTES`, the weights by what its config implies (`weight_bytes`), and
a download by the most any drafter of the served target can hold (`max_artifact_bytes`).
This file does not train, serve or register drafters.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specloop.engine.model.config import ModelConfig
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter

FORMAT = "specloop-dflash-drafter"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "drafter.json"
MAX_CONFIG_BYTES = 1 << 20  # the shipped drafter's is 1.5 kB; its lineage may grow, not by this much
_SAFETENSORS_HEADER_BYTES = 1 << 20  # the JSON header of names, shapes and offsets; a few kB in practice


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
    """The parsed `drafter.json` of an artifact, checked for size, format and version."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise ValueError(f"drafter artifact {path}: no {CONFIG}")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"drafter artifact {path}: {CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    meta = json.loads(file.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"drafter artifact {path}: {CONFIG} is not a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"drafter artifact {path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"drafter artifact {path}: format_version {meta.get('format_version')} is not supported")
    return meta


def weight_bytes(config: DFlashConfig) -> int:
    """The most bytes a weights file of this architecture can take (every tensor fp32, `vocab_ids`
    int64), from the config alone: nothing is allocated, whatever it asks. tests/engine/speculation
    checks it against a built drafter's state dict."""
    c = config
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # q, kv, o
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size + 2 * c.head_dim  # mlp, norms
    fp32 = (len(c.tap_layers) * c.hidden_size * c.hidden_size + 2 * c.hidden_size + c.num_layers * layer
            + (c.hidden_size if c.mask_token_id is None else 0))  # fc, hidden_norm and norm, layers, mask
    return 4 * fp32 + 8 * (c.output_vocab_size or 0) + _SAFETENSORS_HEADER_BYTES


def max_artifact_bytes(target: ModelConfig) -> int:
    """More than any drafter that fits `target` can take on disk: as deep as the target, tapping every
    layer of it (`DFlashConfig.check_target` refuses anything larger)."""
    widest = DFlashConfig(
        num_layers=target.num_layers, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        vocab_size=target.vocab_size, max_position=target.max_position, tap_layers=tuple(range(target.num_layers)),
        target_num_layers=target.num_layers)
    return weight_bytes(widest) + MAX_CONFIG_BYTES


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

"""The drafters that ship with specloop, and how the embedded stack seeds its registry with them.

`daemon/drafters/<model>/` holds one drafter artifact per default model (the weights, `drafter.json`
with its base-model fingerprint and lineage, and a README saying how it was made). `specloop up`
calls `seed_registry` before serving: a base model with no drafter version in the registry gets the
shipped one as version 1, with `champion` pointing at it, so `make run` drafts with DFlash from its
first start on a fresh machine. A registry that already holds versions for that model is left
alone: what the retraining loop promoted there wins over what shipped.

Not here: reading or checking artifacts beyond their fingerprint (`engine/speculation/`), the
registry's names and tags (`storage/registry.py`).
"""

import json
import logging
from pathlib import Path

from specloop.storage.registry import CHAMPION, DrafterRegistry, DrafterVersion

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parent / "drafters"


def shipped_drafters(root: Path = SHIPPED) -> dict[str, Path]:
    """Base-model fingerprint -> artifact directory, for every drafter shipped under `root`."""
    found = {}
    for meta in sorted(root.glob("*/drafter.json")):
        found[json.loads(meta.read_text())["base_model_fingerprint"]] = meta.parent
    return found


def seed_registry(registry: DrafterRegistry, root: Path = SHIPPED) -> list[DrafterVersion]:
    """Register each shipped drafter whose base model has no version yet, and make it champion."""
    seeded = []
    for fingerprint, artifact in shipped_drafters(root).items():
        if registry.versions(fingerprint):
            continue
        version = registry.register(artifact, fingerprint, {"source": f"shipped:{artifact.name}"})
        registry.set_alias(fingerprint, CHAMPION, version.version)
        log.info("registry seeded: shipped drafter %s is %s and champion of %s", artifact.name, version.label,
                 fingerprint)
        seeded.append(version)
    return seeded

"""The checkpoint: the resumable state of a training run, `OUT/checkpoint.pt`.

It holds everything a stopped run needs to go on exactly as if it had not stopped: the drafter's
weights, AdamW's state, the step and the time spent, the counters, the early-stopping state and the
evaluation history. A resumed run must train on the same data and the same drafter architecture;
the data digest and the drafter config are stored to refuse anything else. Written atomically (a
run killed mid-write leaves the previous checkpoint).

Not here: the drafter artifact that a finished run writes (`engine/speculation/drafter_artifact.py`),
a model read from disk (`engine/loaders/stored_model.py`'s `StoredModel`).
"""

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint.pt"


@dataclass
class Checkpoint:
    """One training run's resumable state; the fields are the keys of the saved dict."""

    drafter: dict[str, torch.Tensor]  # the drafter's current weights
    opt: dict[str, Any]  # AdamW's state
    step: int
    elapsed: float  # seconds trained
    best_loss: float | None
    best_state: dict[str, torch.Tensor] | None  # the weights with the best held-out loss
    bad_evals: int
    history: list[dict]
    data_digest: str
    supervised_seen: int
    first_drafts_seen: int
    config: dict[str, Any]  # the drafter's `DFlashConfig` as a dict

    @staticmethod
    def exists(out: Path) -> bool:
        return (out / CHECKPOINT).is_file()

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (CHECKPOINT + ".tmp")
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, tmp)
        tmp.replace(out / CHECKPOINT)

    @classmethod
    def load(cls, out: Path, device: torch.device, data_digest: str, config: dict[str, Any]) -> "Checkpoint":
        """The checkpoint in `out`; ValueError when it was trained on other data or another architecture."""
        state = torch.load(out / CHECKPOINT, map_location=device, weights_only=False)
        if state["data_digest"] != data_digest:
            raise ValueError(f"{out / CHECKPOINT} was trained on other data ({state['data_digest']}); "
                             "use another out_dir or resume=False")
        if state["config"] != config:
            raise ValueError(f"{out / CHECKPOINT} has another drafter architecture; use another out_dir")
        # Older checkpoints lack the counters, and some hold an LR scheduler's state ("sched") that
        # the schedule, now a function of the step, no longer needs.
        known = {f.name for f in fields(cls)}
        return cls(**{"supervised_seen": 0, "first_drafts_seen": 0, **{k: v for k, v in state.items() if k in known}})

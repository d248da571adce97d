"""`TrainConfig`: the settings of one drafter training run, validated once when it is built.

Each field made with `option(...)` is also a `specloop train-drafter` option: its default and help
are declared here and nowhere else (`daemon/training/cli.py` builds the command's options from
them). The other fields (`out_dir`, which the command takes as `--out`, `weight_decay`,
`grad_clip`) are for callers in code only.

A `TrainConfig` also travels whole as a JSON file (`write`/`read`): the daemon hands one to the
processes it starts under torchrun (`train-drafter --config FILE`), so the fields that are no option
(`weight_decay`, `grad_clip`) reach them too and nothing is rendered into flags and parsed back.

Not here: parsing the command line (`daemon/training/cli.py`), what the settings do (the modules
of `daemon/training/` that read them).
"""

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Option:
    """How a `TrainConfig` field is offered on the command line."""

    help: str | None = None
    flag: str | None = None  # the option's name, where it is not the field's (`--steps` for max_steps)
    flag_type: Any = None  # the option's annotation, where it is not the field's
    to_field: Callable[[Any], Any] | None = None  # a given (not None) option value as the field's value
    from_field: Callable[[Any], Any] | None = None  # the inverse of `to_field`, where it is not the identity


def option(default: Any, help: str | None = None, **how: Any) -> Any:
    """A field with `default` that `train-drafter` offers as an option (`Option` says how)."""
    return field(default=default, metadata={"option": Option(help, **how)})


def _minutes_to_seconds(minutes: float) -> float:
    return minutes * 60


def _seconds_to_minutes(seconds: float) -> float:
    return seconds / 60


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    # Drafter shape; None: 1 layer, 5 taps, block 16 for a new drafter, the warm start's own otherwise.
    num_layers: int | None = option(
        None, "Drafter layers (default 1; with --init-from the artifact's, and more appends layers)", flag="layers")
    num_taps: int | None = option(None, "Tapped target layers (default 5; with --init-from the artifact's)",
                                  flag="taps")
    block_size: int | None = option(None, "Trained block size (default 16; with --init-from the artifact's)")
    max_steps: int = option(1000, flag="steps")
    # Seconds here, minutes on the command line.
    max_seconds: float | None = option(None, "Wall-clock budget; the LR anneals over it when it ends first",
                                       flag="max_minutes", to_field=_minutes_to_seconds,
                                       from_field=_seconds_to_minutes)
    batch_size: int = option(4)
    num_anchors: int = option(32, "Blocks per sequence per step", flag="anchors")
    max_seq_len: int = option(1024)
    lr: float = option(6e-4)
    warmup_ratio: float = option(0.04)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = option(7.0, "Loss decay over block positions: exp(-(k-1)/gamma)")  # the paper's decay for B = 16
    seed: int = option(0)
    heldout_fraction: float = option(0.05)
    eval_every: int = option(50)
    patience: int = option(5)  # evaluations without a better held-out loss before stopping
    checkpoint_every: int = option(100)
    resume: bool = option(True, "Continue from OUT/checkpoint.pt when present")
    # Paths are str here: the warm start's goes into the artifact's JSON lineage.
    init_from: str | None = option(None, "Warm start from this drafter artifact", flag_type=Path | None, to_field=str)
    trim_vocab: bool = option(
        False, "Output only tokens seen in training responses (with --init-from: add them to the artifact's)")
    distill: bool = option(False, "Also anchor in prompts; labels are the target's own greedy predictions")
    skip_suffix_covered: bool = option(
        False, "Anchor no block where suffix decoding drafts in the drafter's place (dflash+suffix serving)")
    mixed_precision: bool = option(False, "bf16 autocast for the drafter (fp32 master weights)")
    # Target taps of training sequences kept in memory up to this size, and optionally in feature_dir
    # for later runs (`specloop.daemon.training.feature_store`).
    feature_cache_gb: float = option(4.0, "Memory for cached target hidden states; 0 = off")
    feature_dir: str | None = option(
        None, "Also keep the target's hidden states here, so later runs on the same sequences skip the target",
        flag_type=Path | None, to_field=str)
    feature_dir_gb: float | None = option(
        None, "Cap --feature-dir at this size; the least recently used files go first (default: no cap)")
    eval_tau: bool = option(False, "Replay held-out tau at every evaluation (a tau-vs-time curve)")
    progress: bool = option(True)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_taps", "max_steps", "batch_size", "num_anchors", "eval_every",
                     "patience", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.lr <= 0 or self.gamma <= 0 or self.grad_clip <= 0:
            raise ValueError(f"lr, gamma and grad_clip must be > 0, got {self.lr}, {self.gamma}, {self.grad_clip}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.feature_cache_gb < 0:
            raise ValueError(f"feature_cache_gb must be >= 0, got {self.feature_cache_gb}")
        if self.feature_dir_gb is not None and (self.feature_dir is None or self.feature_dir_gb <= 0):
            raise ValueError(f"feature_dir_gb needs a feature_dir and must be > 0, got {self.feature_dir_gb}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> "TrainConfig":
        """The config `write` wrote; ValueError naming the field for an unknown, missing or invalid one."""
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a training config ({e})") from e
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a training config is a JSON object")
        unknown = values.keys() - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown training config fields {sorted(unknown)}")
        try:
            return cls(**values)
        except TypeError as e:  # a required field left out
            raise ValueError(f"{path}: {e}") from e

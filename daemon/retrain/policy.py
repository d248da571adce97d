"""The retrain policy: when the daemon refits a drafter, on what data, and what a challenger must show.

A policy is a YAML file validated by the pydantic models below; `load_policy` turns every error into
one line naming the field's dotted path and its line in the file ("gate.min_relative_gain (line 31):
Input should be greater than or equal to 0"). Sections, each with defaults a first deployment can
keep: `schedule` (cron or interval), `triggers` (what makes a scheduled tick train), `data`
(window and limits of the dataset), `training` (budget and warm start), `evaluation` (the held-out
set), `gate` (what a challenger must beat), `rollout` (watching live τ after a promotion) and
`cooldown_minutes`. The commented examples in `daemon/policies/` say what each field means.

Not here: acting on a policy (`daemon/retrain/run.py`, `service.py`, `rollback.py`), or where
things are stored (`daemon/retrain/settings.py`: registry URI, trace root, state database).
"""

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel, ConfigDict, Field, FilePath, ValidationError, model_validator

Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


class _Section(BaseModel):
    # An unknown key is a typo until proven otherwise: a misspelt `min_relative_gian` must not
    # silently leave the gate at its default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class Schedule(_Section):
    """When the daemon checks its triggers: a crontab line (UTC) or a fixed interval, not both."""

    cron: str | None = None
    interval_minutes: Positive | None = None
    # A tick missed while the daemon was down still runs on restart if it is at most this late
    # (APScheduler's misfire grace time); ticks missed together coalesce into one run.
    misfire_grace_minutes: Positive = 60.0

    @model_validator(mode="after")
    def _one_kind(self) -> "Schedule":
        if (self.cron is None) == (self.interval_minutes is None):
            raise ValueError("give exactly one of cron or interval_minutes")
        if self.cron is not None:
            try:
                CronTrigger.from_crontab(self.cron, timezone="UTC")
            except ValueError as e:
                raise ValueError(f"cron {self.cron!r} is not a crontab line: {e}") from None
        return self


class Triggers(_Section):
    """A tick trains when any trigger fires and the dataset has at least `data.min_traces`.

    `min_new_traces`: consented traces newer than the last run's data. `max_champion_age_hours`:
    the champion is older than this (None: never by age). `live_tau_below`: the champion's live τ
    over the last `rollout.watch_minutes` fell below this (None: never by τ). `first_drafter`: the
    served base model has no registered drafter at all (a model that ships none, an NVFP4 variant):
    the daemon's first tick trains one at once (the data: `data.first_drafter_prompts`), and a run
    that ended without registering one is tried again after `cooldown_minutes`.
    """

    min_new_traces: PositiveInt = 200
    max_champion_age_hours: Positive | None = None
    live_tau_below: Annotated[float, Field(ge=1)] | None = None
    first_drafter: bool = True


class OnErasure(StrEnum):
    """What happens to a drafter trained on a subject erased since (`erasures.py`)."""

    KEEP = "keep"
    FLAG = "flag"
    RETIRE = "retire"


class Data(_Section):
    """The training dataset: the newest `max_traces` consented traces of the last `window_days`."""

    window_days: Positive | None = 14.0
    max_traces: PositiveInt | None = 20_000
    min_traces: PositiveInt = 50
    purpose: str = "drafter_training"  # the consent purpose a trace's subject must have granted
    # A base model with no champion and too few traces of its own trains on the prompts of the base
    # model with the most traces, answered again by the new target (`bootstrap.py`).
    bootstrap_from_other_models: bool = True
    # With no traces to bootstrap from, a first drafter trains on the target's answers to the first this
    # many prompts of `first_drafter_prompts_file` (JSONL of {"messages": [...]}; None: the 256 that ship,
    # `bootstrap.py`); 0: never. SmolLM2 NVFP4 answered 128 in 93-99 s on 2 cores of the AMX Xeon
    # (docs/performance.md, "A served weight format's first drafter").
    first_drafter_prompts: Annotated[int, Field(ge=0, le=4096)] = 128
    first_drafter_prompts_file: FilePath | None = None
    # What happens to a registered drafter whose training set held a subject erased since
    # (`erasures.py`): keep it, flag it in the registry, or retire it from champion as well.
    on_erasure: OnErasure = OnErasure.FLAG


class Training(_Section):
    """The budget of one refit; whichever of steps and minutes ends first stops it."""

    max_steps: PositiveInt = 600
    max_minutes: Positive = 10.0
    warm_start: bool = True  # from the champion's weights (a new drafter when there is none)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 only where this CPU computes it natively
    batch_size: PositiveInt = 4
    anchors: PositiveInt = 256
    lr: Positive = 3e-4
    distill: bool = True
    # Anchor no block where suffix decoding drafts in the drafter's place (`daemon/training/suffix_covered.py`).
    skip_suffix_covered: bool = False
    block_size: Annotated[int, Field(ge=2)] | None = None  # None: the champion's (16 for a new drafter)
    processes: PositiveInt = 1  # > 1: the trainer runs data-parallel in that many processes under torchrun


class Evaluation(_Section):
    """The held-out set: the dataset's eval split (recent traces never trained on)."""

    heldout_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    min_heldout: PositiveInt = 20
    max_heldout: PositiveInt = 200  # replay costs a target pass per sequence: cap the gate's time
    slices: list[Literal["tenant", "endpoint"]] = []  # also report τ per tenant or endpoint


class Gate(_Section):
    """What promotes a challenger: decode speed at least `min_relative_gain` above the champion's, both
    modelled in the same run on the same held-out set with the proposer serving uses, with the gain's
    `confidence` interval not below zero (`daemon/retrain/gate.py`)."""

    # Negative: a challenger up to this much slower passes too (tests of the plumbing, never production).
    min_relative_gain: Annotated[float, Field(ge=-1)] = 0.02
    confidence: Annotated[float, Field(gt=0, lt=1)] = 0.95
    require_approval: bool = False  # wait for `approval=approved` (MLflow UI or `specloop approve`)


class Rollout(_Section):
    """Watching the new champion's live τ; it is rolled back when it falls below
    `rollback_below` x the previous champion's live τ once it has `min_verify_steps` steps."""

    watch_minutes: Positive = 30.0
    min_verify_steps: PositiveInt = 200
    rollback_below: Annotated[float, Field(gt=0, le=1)] = 0.9


class RetrainPolicy(_Section):
    schedule: Schedule
    triggers: Triggers = Triggers()
    data: Data = Data()
    training: Training = Training()
    evaluation: Evaluation = Evaluation()
    gate: Gate = Gate()
    rollout: Rollout = Rollout()
    cooldown_minutes: Annotated[float, Field(ge=0)] = 60.0  # no run this soon after a promotion or rollback


class PolicyError(ValueError):
    """A policy file that does not validate: one line per problem, each naming field and line."""


def load_policy(path: Path | str) -> RetrainPolicy:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read the policy: {e.strerror}") from None
    return parse_policy(text, str(path))


def parse_policy(text: str, where: str = "<policy>") -> RetrainPolicy:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise PolicyError(f"{where}{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: a policy is a YAML mapping with at least a `schedule` section")
    try:
        return RetrainPolicy.model_validate(data)
    except ValidationError as e:
        raise PolicyError("\n".join(_describe(err, root, where) for err in e.errors())) from None


def _describe(err: Any, root: yaml.Node, where: str) -> str:
    loc = [part for part in err["loc"] if not _is_validator_name(part)]
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = _line_of(root, loc)
    return f"{where}: {field}{f' (line {line})' if line else ''}: {err['msg']}"


def _is_validator_name(part: Any) -> bool:
    # pydantic adds the union member's type to a location ("max_steps.int"); the user wrote no such key.
    return isinstance(part, str) and part in ("int", "float", "str", "bool", "list", "literal[...]")


def _line_of(node: yaml.Node, loc: list[Any]) -> int | None:
    """1-based line of the deepest node on `loc` that exists in the file (a missing key: its parent)."""
    line = node.start_mark.line + 1
    for part in loc:
        child = _child(node, part)
        if child is None:
            break
        node, line = child, child.start_mark.line + 1
    return line


def _child(node: yaml.Node, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        return next((v for k, v in node.value if k.value == str(part)), None)
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None

"""One retraining run, step by step, each step logged, timed and written to the run log.

dataset (the DuckDB builder over consented traces of the served base model, consent re-checked
against a fresh snapshot, manifest written; with no champion and too few traces, a first drafter's
data from `bootstrap.py`) → champion (download, for the warm start and the contest; a first
drafter starts from the nearest other base model's champion that fits) → train (the challenger) →
evaluate (suffix decoding alone, champion and challenger replayed on the same held-out traces) →
gate → register (the champion tagged with its speed over suffix decoding alone, which decides
whether engines draft with it; one MLflow run with params, metrics, the dataset through
`log_inputs` with its digest, and the artifact; then one version created with every tag at once) →
promote (move `champion`), or set `challenger` and wait for approval, or refuse.
Consent is checked again just before `register` and just before `promote`: if any consent behind
the dataset's traces is no longer in force, the run ends `consent_withdrawn` with nothing
registered, or its registered version is refused with that reason (in the history and its tags),
and the next tick builds a dataset without those traces.

Nothing is half-registered: everything before `register` is local files, the version is created
with all its tags in one call, and the alias moves after. A run stopped before `register`
(SIGTERM, a lost lease) is `abandoned`; one stopped after it is resumed by `resume_promotion` when
the daemon starts again. MLflow or a trace file failing makes the run `failed`; the schedule
tries again at the next tick.

Not here: when to run (`triggers.py`, `service.py`), the decisions (`gate.py`), the alias moves
(`promotion.py`), the trainer and the replay (`daemon/training/`, `daemon/evaluation/`).
"""

import logging
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from mlflow.entities import DatasetInput, InputTag
from mlflow.exceptions import MlflowException

from specloop.consent.registry import ConsentRegistry
from specloop.daemon.evaluation.canary import canary_tau
from specloop.daemon.retrain import gate as gates
from specloop.daemon.retrain import promotion
from specloop.daemon.retrain.bootstrap import bootstrap, held_out, shipped_answers
from specloop.daemon.retrain.challenger import RunStopped, train_challenger, train_config
from specloop.daemon.retrain.contest import CHALLENGER, CHAMPION, SUFFIX, Contest, run_contest
from specloop.daemon.retrain.history import Action, PromotionHistory
from specloop.daemon.retrain.policy import RetrainPolicy
from specloop.daemon.retrain.run_log import RunLog, RunOutcome
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.daemon.training.prompts import FIRST_DRAFTER
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.speculation.drafter_artifact import load_drafter, max_artifact_bytes, read_meta
from specloop.storage.dataset import DatasetManifest, build_dataset
from specloop.storage.dataset_copies import Lineage, erasures_of, read_lineage, record_lineage
from specloop.storage.registry import Approval, DrafterRegistry, DrafterVersion, RegistryUnavailable, Tag, tau_tags
from specloop.storage.sequences import TokenSequence, digest

log = logging.getLogger(__name__)


@dataclass
class Loop:
    """The daemon's long-lived parts, shared by every run for one base model."""

    policy: RetrainPolicy
    settings: DaemonSettings
    registry: DrafterRegistry
    target: LoadedModel
    runs: RunLog
    history: PromotionHistory

    @property
    def base_model(self) -> str:
        return self.target.fingerprint


@dataclass(frozen=True)
class Prepared:
    manifest: DatasetManifest | None  # of the traces selected (another base model's, when bootstrapped)
    train: list[TokenSequence]
    heldout: list[TokenSequence]
    slice_keys: list[str] | None
    directory: Path
    dataset_digest: str  # of what is trained on
    # The base model whose prompts this target answered again, or `SHIPPED_PROMPTS` (then no manifest).
    bootstrap_from: str | None = None
    # Every consent behind the traces trained and judged on, read when the dataset was built: an
    # erasure may scrub the files on disk during training, and the re-checks must still see them.
    consent_ids: frozenset[str] = frozenset()


_RUN_ID_TIME = "%Y%m%d-%H%M%S"
SHIPPED_PROMPTS = "shipped-prompts"  # `bootstrap_from` of a first drafter trained on the shipped prompts


def new_run_id() -> str:
    return f"{datetime.now(UTC):{_RUN_ID_TIME}}-{uuid.uuid4().hex[:6]}"


def run_started(run_id: str) -> datetime | None:
    """When the run named `run_id` started; None for a name no run has (`drafters/`, a scratch folder)."""
    try:
        return datetime.strptime(run_id[:15], _RUN_ID_TIME).replace(tzinfo=UTC)
    except ValueError:
        return None


class RetrainRun:
    """`execute()` runs every step once and returns the outcome; the run log holds the details."""

    def __init__(self, loop: Loop, run_id: str, stop: threading.Event,
                 should_stop: Callable[[], str | None] = lambda: None) -> None:
        self.loop, self.run_id, self.stop, self.should_stop = loop, run_id, stop, should_stop
        self.dir = loop.settings.work_dir / run_id
        self.timings: dict[str, float] = {}
        self.started = datetime.now(UTC)
        self.warm_from: DrafterVersion | None = None  # the champion the challenger started from

    def execute(self) -> RunOutcome:
        loop = self.loop
        loop.runs.start(self.run_id, loop.base_model, self.started)
        log.info("run %s for %s: starting", self.run_id, loop.base_model)
        try:
            outcome, detail = self._steps()
        except RunStopped as e:
            outcome, detail = RunOutcome.ABANDONED, str(e)
        except (RegistryUnavailable, MlflowException) as e:
            outcome, detail = RunOutcome.FAILED, f"MLflow: {e}"
        except Exception as e:  # a bad trace file, a broken champion: this run fails, the daemon keeps going
            log.exception("run %s failed", self.run_id)
            outcome, detail = RunOutcome.FAILED, f"{type(e).__name__}: {e}"
        loop.runs.finish(self.run_id, outcome, detail, self.timings)
        log.info("run %s: %s (%s) in %.0f s", self.run_id, outcome, detail, sum(self.timings.values()))
        return outcome

    def _steps(self) -> tuple[RunOutcome, str]:
        loop = self.loop
        with self._step("dataset"):
            prepared = self._dataset()
        if isinstance(prepared, str):
            return RunOutcome.SKIPPED, prepared
        with self._step("champion"):
            champion = loop.registry.champion(loop.base_model)
            champion_dir = None if champion is None else self._download(champion)
            if not loop.policy.training.warm_start:
                warm = None
            elif champion is None:  # a first drafter
                self.warm_from, warm = self._nearest(prepared) or (None, None)
            else:
                self.warm_from, warm = champion, champion_dir
        with self._step("train"):
            cfg = train_config(loop.policy.training, self.dir / "challenger", warm, run_seed(self.run_id),
                               _dtype_name(loop.target), len(prepared.train))
            result = train_challenger(cfg, loop.target.model, loop.base_model, prepared.train, self.should_stop,
                                      self.stop, loop.policy.training.processes, loop.target.source,
                                      loop.target.weights)
        with self._step("evaluate"):
            contest = run_contest(loop.target.model, loop.base_model, prepared.heldout, result.artifact,
                                  champion_dir, prepared.slice_keys, prepared.train,
                                  serve_margin=loop.policy.gate.min_relative_gain)
        self._check_stop()
        decision = gates.decide(
            loop.policy.gate, served_base_model=loop.base_model,
            challenger_base_model=read_meta(result.artifact)["base_model_fingerprint"],
            speed=contest.speed_gain(loop.policy.gate.confidence),
            tau_challenger=contest.tau(CHALLENGER), tau_champion=contest.tau_baseline,
            champion_label=_baseline_label(contest, champion))
        log.info("run %s: gate %s: %s", self.run_id, decision.verdict, decision.reason)
        with self._step("canary"):
            tau_canary = canary_tau(loop.target, result.artifact)
        with self._step("register"):
            withdrawn = self._withdrawn(prepared)
            if withdrawn is not None:
                return RunOutcome.CONSENT_WITHDRAWN, f"nothing registered: {withdrawn}"
            if champion is not None:  # what engines serve changes only from a run whose consents still hold
                self._judge_champion(champion, contest)
            version = self._register(prepared, contest, decision, result, champion, tau_canary)
            parent = self.warm_from
            record_lineage(self.dir, Lineage(self.run_id, loop.base_model, version.version,  # what erasure reports
                                             str(prepared.directory.relative_to(self.dir)),
                                             None if parent is None else parent.version,
                                             None if parent is None or parent.base_model == loop.base_model
                                             else parent.base_model))
        self.loop.runs.step(self.run_id, "registered", self.timings, version.version)
        with self._step("promote"):
            withdrawn = self._withdrawn(prepared)
            if withdrawn is not None:  # registered, never served: its gate tag says why
                decision = gates.GateDecision(gates.GateVerdict.REFUSE, withdrawn)
                loop.registry.set_tags(loop.base_model, version.version,
                                       {Tag.GATE: decision.verdict.value, Tag.GATE_REASON: withdrawn})
            return act_on_gate(loop.registry, loop.history, version, decision, self.run_id)

    def _dataset(self) -> Prepared | str:
        """The dataset, or why there is too little data to train (the run is then skipped)."""
        loop, policy = self.loop, self.loop.policy
        consent = ConsentRegistry(loop.settings.consent_db)
        try:
            snapshot = consent.snapshot(policy.data.purpose)
        finally:
            consent.close()
        since = None if policy.data.window_days is None else self.started - timedelta(days=policy.data.window_days)
        directory = self.dir / "dataset"
        try:
            manifest = build_dataset(loop.settings.traces_root, directory, snapshot, base_model=loop.base_model,
                                     since=since, until=self.started, limit=policy.data.max_traces,
                                     eval_fraction=policy.evaluation.heldout_fraction)
        except ValueError as e:  # no trace files yet for this base model
            manifest, why = None, str(e)
        else:
            log.info("run %s: dataset of %d consented traces (%d train, %d held out) from %d files", self.run_id,
                     manifest.consented_traces, manifest.train_rows, manifest.eval_rows, manifest.source_files)
            why = f"{manifest.train_rows} training traces, the policy needs {policy.data.min_traces}"
        if manifest is None or manifest.train_rows < policy.data.min_traces:
            if loop.registry.champion(loop.base_model) is not None:
                return why
            # A first drafter: another base model's consented prompts, else the shipped ones.
            boot = self._bootstrapped(snapshot, since) if policy.data.bootstrap_from_other_models else None
            return boot or self._shipped() or why
        if manifest.eval_rows < policy.evaluation.min_heldout:
            return f"{manifest.eval_rows} held-out traces, the policy needs {policy.evaluation.min_heldout}"
        train = _sequences(directory / "train.parquet")
        heldout_table = pq.read_table(directory / "eval.parquet").slice(0, policy.evaluation.max_heldout)
        heldout = [TokenSequence(tuple(p), tuple(r)) for p, r in zip(
            heldout_table["prompt_token_ids"].to_pylist(), heldout_table["response_token_ids"].to_pylist(),
            strict=True)]
        keys = _slice_keys(heldout_table, policy.evaluation.slices)
        return Prepared(manifest, train, heldout, keys, directory, manifest.content_digest,
                        consent_ids=_consent_ids(directory))

    def _judge_champion(self, champion: DrafterVersion, contest: Contest) -> None:
        """Tag the champion with its speed over suffix decoding alone on this run's held-out traces, and
        whether that falls short of the gate's margin: engines bench it (suffix decoding drafts alone)
        while it does, and serve it again once a later run finds it enough faster."""
        benched = contest.benched(CHAMPION)
        if benched and not champion.benched:
            log.warning("run %s: champion %s + suffix decoding models %+.1f%% against suffix decoding alone, "
                        "below the %.1f%% margin: engines bench it", self.run_id, champion.label,
                        100 * contest.over_suffix(CHAMPION).gain, 100 * contest.serve_margin)
        self.loop.registry.set_tags(self.loop.base_model, champion.version, _suffix_tags(contest, CHAMPION))

    def _withdrawn(self, prepared: Prepared) -> str | None:
        """Why the run must stop because consent changed since its dataset was built, or None: any
        trace it trained or was judged on whose consent is no longer in force (revoked, expired), or
        whose subject was erased meanwhile (the erasure scrubbed the dataset, not the weights)."""
        if self.warm_from is not None and Tag.TRAINED_ON_ERASED in self.loop.registry.version(
                self.warm_from.base_model, self.warm_from.version).tags:  # its weights carry what it started from
            parent = self.warm_from
            return f"warm-started from {parent.base_model} {parent.label}, trained on subjects erased since"
        erased = erasures_of(self.dir)
        if erased:
            log.warning("run %s: %d subjects of its dataset were erased since it was built", self.run_id, len(erased))
            return f"{len(erased)} subjects of its dataset were erased since it was built"
        ids = prepared.consent_ids
        consent = ConsentRegistry(self.loop.settings.consent_db)
        try:
            gone = consent.withdrawn(ids, datetime.now(UTC))
        finally:
            consent.close()
        if not gone:
            return None
        log.warning("run %s: %d of its %d consents are no longer in force", self.run_id, len(gone), len(ids))
        return f"consent withdrawn since the dataset was built ({len(gone)} of {len(ids)} consents no longer in force)"

    def _bootstrapped(self, snapshot: Any, since: datetime | None) -> Prepared | None:
        """Another base model's prompts answered by this target, when they are enough (else None)."""
        policy = self.loop.policy
        boot = bootstrap(self.loop.settings.traces_root, snapshot, self.loop.target, since=since, until=self.started,
                         limit=policy.data.max_traces, eval_fraction=policy.evaluation.heldout_fraction,
                         work_dir=self.dir / "bootstrap")
        if boot is None or len(boot.train) < policy.data.min_traces or len(boot.heldout) < policy.evaluation.min_heldout:
            return None
        heldout = boot.heldout[:policy.evaluation.max_heldout]
        directory = self.dir / "bootstrap" / boot.source
        return Prepared(boot.manifest, boot.train, heldout, None, directory, digest(boot.train),
                        bootstrap_from=boot.source, consent_ids=_consent_ids(directory))

    def _shipped(self) -> Prepared | None:
        """The target's answers to the shipped prompts (no one's data: no consent), when the policy
        asks for some and they are enough (else None)."""
        policy = self.loop.policy
        count = policy.data.first_drafter_prompts
        held = held_out(count, policy.evaluation.heldout_fraction)
        if count < 2 or count - held < policy.data.min_traces or held < policy.evaluation.min_heldout:
            log.warning("run %s: %d shipped prompts would give %d to train on and %d held out, fewer than the "
                        "policy needs", self.run_id, count, max(0, count - held), max(0, held))
            return None
        answers = shipped_answers(self.loop.target, count, policy.evaluation.heldout_fraction,
                                  policy.data.first_drafter_prompts_file or FIRST_DRAFTER)
        if len(answers.train) < policy.data.min_traces or len(answers.heldout) < policy.evaluation.min_heldout:
            log.warning("run %s: the target could read %d of the %d shipped prompts, fewer than the policy needs",
                        self.run_id, len(answers.train) + len(answers.heldout), count)
            return None
        directory = self.dir / SHIPPED_PROMPTS
        directory.mkdir(parents=True, exist_ok=True)
        (directory / answers.prompts.name).write_bytes(answers.prompts.read_bytes())  # what it answered, kept
        return Prepared(None, answers.train, answers.heldout[:policy.evaluation.max_heldout], None, directory,
                        digest(answers.train), bootstrap_from=SHIPPED_PROMPTS)

    def _download(self, v: DrafterVersion) -> Path:
        return self.loop.registry.download(v, self.loop.settings.work_dir / "drafters",
                                           max_artifact_bytes(self.loop.target.model.config))

    def _nearest(self, prepared: Prepared) -> tuple[DrafterVersion, Path] | None:
        """A first drafter's warm start: the champion of the base model this target was quantized from,
        else of the one whose prompts it answered, if that drafter fits this target's shape.

        Its weights are only where training starts (`daemon/training/drafter_init.py`); the lineage
        names it, so an erasure behind it taints this base model's drafter too (`erasures.py`)."""
        loop = self.loop
        candidates = (loop.target.source_fingerprint, prepared.bootstrap_from)
        for base_model in dict.fromkeys(c for c in candidates if c not in (None, SHIPPED_PROMPTS, loop.base_model)):
            parent = loop.registry.champion(base_model)
            if parent is None:
                continue
            path = self._download(parent)
            try:
                load_drafter(path, None).drafter.config.check_target(loop.target.model.config)
            except ValueError as e:
                log.info("run %s: no warm start from %s of %s: %s", self.run_id, parent.label, base_model, e)
                continue
            log.info("run %s: first drafter of %s, warm-started from %s of %s", self.run_id, loop.base_model,
                     parent.label, base_model)
            return parent, path
        return None

    def _register(self, prepared: Prepared, contest: Contest, decision: gates.GateDecision, result: Any,
                  champion: DrafterVersion | None, tau_canary: float) -> DrafterVersion:
        loop = self.loop
        registry = loop.registry
        mlflow_run = registry.start_run(loop.base_model, f"retrain-{self.run_id}", {Tag.RUN: self.run_id})
        try:
            params = {**_flat("policy", loop.policy.model_dump(mode="json")), "champion":
                      "none" if champion is None else champion.label, "train_steps": result.steps,
                      "stop_reason": result.stop_reason, "dataset_digest": prepared.dataset_digest,
                      "bootstrap_from": prepared.bootstrap_from or "none"}
            metrics = {**contest.metrics(), "train_seconds": result.seconds, "final_train_loss": result.final_train_loss,
                       **{f"seconds_{k}": v for k, v in self.timings.items()}}
            if result.best_heldout_loss is not None:
                metrics["best_heldout_loss"] = result.best_heldout_loss
            registry.log_run(mlflow_run, params, metrics, [_dataset_input(prepared)])
            tags = {**tau_tags(contest.tau(CHALLENGER), contest.tau_baseline), Tag.EVAL_SET: contest.eval_set,
                    Tag.DATASET: prepared.dataset_digest, Tag.GATE: decision.verdict.value,
                    Tag.GATE_REASON: decision.reason, Tag.RUN: self.run_id, Tag.TAU_CANARY: f"{tau_canary:.6f}",
                    **_suffix_tags(contest, CHALLENGER)}
            if decision.verdict is gates.GateVerdict.AWAIT_APPROVAL:
                tags[Tag.APPROVAL] = Approval.PENDING.value
            if prepared.bootstrap_from is not None:
                tags[Tag.BOOTSTRAP_FROM] = prepared.bootstrap_from
            if self.warm_from is not None and self.warm_from.base_model != loop.base_model:
                tags[Tag.WARM_START_FROM] = f"{self.warm_from.base_model} {self.warm_from.label}"
            version = registry.register(result.artifact, loop.base_model, tags, run_id=mlflow_run)
        except BaseException:
            _end_quietly(registry, mlflow_run, "FAILED")
            raise
        registry.end_run(mlflow_run)
        log.info("run %s: registered %s of %s", self.run_id, version.label, version.name)
        return version

    def _check_stop(self) -> None:
        why = "stop requested" if self.stop.is_set() else self.should_stop()
        if why is not None:
            raise RunStopped(f"stopped after step {list(self.timings)[-1]}: {why}")

    @contextmanager
    def _step(self, name: str) -> Iterator[None]:
        self.loop.runs.step(self.run_id, name, self.timings)
        log.info("run %s: step %s", self.run_id, name)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = round(time.monotonic() - t0, 2)
        log.info("run %s: step %s done in %.1f s", self.run_id, name, self.timings[name])


def _suffix_tags(contest: Contest, contender: str) -> dict[str, str]:
    return {Tag.SPEED_OVER_SUFFIX: str(contest.over_suffix(contender).gain),
            Tag.BENCHED: str(contest.benched(contender)).lower()}


def _baseline_label(contest: Contest, champion: DrafterVersion | None) -> str:
    """What the challenger was measured against, for the gate's reason."""
    if champion is None:
        return "suffix decoding alone"
    if contest.baseline == SUFFIX:
        return f"suffix decoding alone ({champion.label} + suffix decoding benched)"
    return champion.label


def act_on_gate(registry: DrafterRegistry, history: PromotionHistory, version: DrafterVersion,
                decision: gates.GateDecision, run_id: str) -> tuple[RunOutcome, str]:
    """Move the aliases as the gate decided and record it; the run's outcome."""
    if decision.verdict is gates.GateVerdict.PROMOTE:
        promotion.promote(registry, history, version, decision.reason, run_id=run_id)
        return RunOutcome.PROMOTED, f"{version.label} promoted: {decision.reason}"
    if decision.verdict is gates.GateVerdict.AWAIT_APPROVAL:
        promotion.await_approval(registry, history, version, decision.reason, run_id=run_id)
        return RunOutcome.AWAITING_APPROVAL, f"{version.label} awaits approval: {decision.reason}"
    champion = registry.champion(version.base_model)
    history.record(version.base_model, Action.REFUSED, version.label, decision.reason,
                   previous=None if champion is None else champion.label, run_id=run_id)
    return RunOutcome.REFUSED, f"{version.label} refused: {decision.reason}"


def resume_promotion(loop: Loop) -> list[str]:
    """Finish what runs killed after `register` left: the version exists with its gate tag, the
    alias move and its history row may not. Other unfinished runs are marked abandoned."""
    resumed = []
    for run in loop.runs.runs(loop.base_model):
        if run.outcome is not RunOutcome.RUNNING:
            continue
        if run.version is not None:  # set once the version exists with its gate tag
            v = loop.registry.version(loop.base_model, run.version)
            run_dir = loop.settings.work_dir / run.run_id
            if read_lineage(run_dir).version is None:  # killed before noting it: which dataset is unknown
                record_lineage(run_dir, Lineage(run.run_id, loop.base_model, v.version))
            decision = gates.GateDecision(gates.GateVerdict(v.tags[Tag.GATE]), v.tags.get(Tag.GATE_REASON, ""))
            done = loop.history.last(loop.base_model)
            if done is not None and done.version == v.label and done.run_id == run.run_id:
                outcome, detail = RunOutcome(_OUTCOME_OF[done.action]), f"{v.label}: {done.reason}"
            else:
                outcome, detail = act_on_gate(loop.registry, loop.history, v, decision, run.run_id)
            loop.runs.finish(run.run_id, outcome, f"resumed after a restart: {detail}", run.timings)
            resumed.append(run.run_id)
    abandoned = loop.runs.abandon_unfinished(loop.base_model, "the daemon stopped before the run registered anything")
    for run in abandoned:
        log.warning("run %s was abandoned at step %s by a daemon that stopped", run.run_id, run.step)
    return resumed


_OUTCOME_OF = {Action.PROMOTED: RunOutcome.PROMOTED, Action.AWAITING_APPROVAL:
               RunOutcome.AWAITING_APPROVAL, Action.REFUSED: RunOutcome.REFUSED,
               Action.REJECTED: RunOutcome.REFUSED}


def _consent_ids(directory: Path) -> frozenset[str]:
    return frozenset(i for part in ("train", "eval") for i in pq.read_table(
        directory / f"{part}.parquet", columns=["consent_id"])["consent_id"].to_pylist())


def _sequences(path: Path) -> list[TokenSequence]:
    table = pq.read_table(path, columns=["prompt_token_ids", "response_token_ids"])
    return [TokenSequence(tuple(p), tuple(r)) for p, r in zip(
        table["prompt_token_ids"].to_pylist(), table["response_token_ids"].to_pylist(), strict=True)]


def _slice_keys(table: Any, slices: list[str]) -> list[str] | None:
    if not slices:
        return None
    columns = [table[name].to_pylist() for name in slices]
    return ["_".join(_metric_safe(f"{name}-{value}") for name, value in zip(slices, row, strict=True))
            for row in zip(*columns, strict=True)]


def _metric_safe(text: str) -> str:
    """MLflow metric names allow letters, digits, `_-. /`; tenant names and endpoints fit after this."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _dataset_input(prepared: Prepared) -> DatasetInput:
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():  # two registered sources both claim file:// URIs; either is right
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(prepared.directory.resolve().as_uri())
    manifest = prepared.manifest
    # MLflow keeps at most 36 characters of a digest: the hex of our sha256, cut; the full one is a param.
    if manifest is None:  # the shipped prompts, answered by this target
        dataset = MetaDataset(source, name=SHIPPED_PROMPTS, digest=prepared.dataset_digest.removeprefix("sha256:")[:36])
        tags = [InputTag("train_rows", str(len(prepared.train))), InputTag("eval_rows", str(len(prepared.heldout)))]
    else:
        dataset = MetaDataset(source, name=f"traces-{manifest.base_model}",
                              digest=manifest.content_digest.removeprefix("sha256:")[:36])
        tags = [InputTag("train_rows", str(manifest.train_rows)), InputTag("eval_rows", str(manifest.eval_rows)),
                InputTag("consent_snapshot", manifest.consent_snapshot_digest)]
    return DatasetInput(dataset._to_mlflow_entity(), [InputTag("mlflow.data.context", "training"), *tags])


def _flat(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(f"{prefix}.{k}", v))
        return out
    return {prefix: value}


def _dtype_name(target: LoadedModel) -> str:
    return str(target.model.dtype).removeprefix("torch.")


def run_seed(run_id: str) -> int:
    """The training seed of run `run_id` (a benchmark retraining its data with another recipe reuses it)."""
    return int(uuid.uuid5(uuid.NAMESPACE_OID, run_id).int % 2**31)


def _end_quietly(registry: DrafterRegistry, run_id: str, status: str) -> None:
    try:
        registry.end_run(run_id, status)
    except (RegistryUnavailable, MlflowException):  # MLflow is what failed; the run stays RUNNING there
        log.warning("could not mark MLflow run %s %s", run_id, status)


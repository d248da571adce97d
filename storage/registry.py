"""The drafter registry: the contract the engine and the retraining daemon share over MLflow.

One MLflow registered model per base model, `specloop-drafter-<fingerprint>`; each version is one
drafter artifact. The engine serves the version behind the `champion` alias; the daemon registers
candidates, tags them (`Tag`: base model, τ of challenger and champion on one eval set, eval-set
and dataset digests, gate decision and reason, approval) and moves aliases. This module holds those
names and the calls both sides make: register, look up (by version, by alias, all), tag, move an
alias, and download a version's artifact directory. docs/architecture.md, "Registry".

The same code serves the embedded default, a `sqlite:///` database with artifacts in a local
directory, and a production MLflow tracking server over http(s). Each registry has its own
`MlflowClient`, never MLflow's global fluent state, so two registries in one process do not mix.

Not here: the gate (the daemon decides and records its decision in tags), validating an artifact
beyond the fingerprint key of `drafter.json` (the engine loads and checks it before use), polling
the alias or retrying (the engine's follower does, on `RegistryUnavailable`), telling engines of a
change (the writer passes `on_serving_change`: daemon/retrain/engine_notice.py), and the promotion
log (the registry keeps no alias history). storage imports nothing of ours, so an artifact is an
opaque directory here and the base-model fingerprint is always an argument.
"""

import json
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from urllib.parse import unquote, urlparse

import mlflow.artifacts
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, Metric, Param
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT
from mlflow.exceptions import MlflowException

CHAMPION = "champion"
CHALLENGER = "challenger"
EXPERIMENT = "specloop-drafters"
ARTIFACT_PATH = "drafter"  # the run artifact folder a version's `source` points at
# The artifact's two files, as engine/speculation/drafter_artifact.py names them (storage may not
# import engine; tests check the names agree). A training directory also holds `checkpoint.pt`, the
# weights plus AdamW's two moments plus the best weights (about 4x model.safetensors), which serving
# never reads: only these two files are registered.
WEIGHTS = "model.safetensors"
CONFIG = "drafter.json"
FINGERPRINT_KEY = "base_model_fingerprint"

_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"
_ALREADY_EXISTS = "RESOURCE_ALREADY_EXISTS"
_MIN_PASSWORD_CHARS = 16
_NO_TAGS: Mapping[str, str] = MappingProxyType({})


class Tag:
    """Version tag keys. MLflow stores every tag value as a string."""

    BASE_MODEL = "base_model"  # the fingerprint; always set by `register`
    TAU_CHALLENGER = "tau_challenger"  # this version's τ on `EVAL_SET`
    TAU_CHAMPION = "tau_champion"  # the serving champion's τ on the same set, measured in the same run
    EVAL_SET = "eval_set"  # digest of the held-out set both τ were measured on
    DATASET = "dataset"  # digest of the training dataset
    GATE = "gate"  # the daemon's decision
    GATE_REASON = "gate_reason"
    APPROVAL = "approval"  # an `Approval`
    PREVIOUS_CHAMPION = "previous_champion"  # the champion this version replaced when it was promoted
    ROLLED_BACK = "rolled_back"  # why this version stopped being champion, when live τ fell
    RUN = "retrain_run"  # the daemon run that produced it
    # A first drafter's: the base model whose prompts it was trained on (or "shipped-prompts"), and the
    # other base model's drafter its weights started from ("<base model> v<N>").
    BOOTSTRAP_FROM = "bootstrap_from"
    WARM_START_FROM = "warm_start_from"
    TAU_CANARY = "tau_canary"  # τ on the canary probes at registration (engine/speculation/canary.py)
    TRAINED_ON_ERASED = "trained_on_erased"  # how many subjects erased since were in its training set
    # Its modelled decode-speed gain (drafter + suffix decoding over suffix decoding alone) in the newest
    # contest that replayed it, and whether that fell short of the policy's margin: "true" while engines
    # bench it (suffix decoding drafts alone), "false" (or no tag: not judged yet) while it drafts.
    SPEED_OVER_SUFFIX = "speed_over_suffix"
    BENCHED = "benched"


class Approval(StrEnum):
    """Whether a person has signed off on a version (the `approval` tag)."""

    PENDING = "pending"
    APPROVED = "approved"
    REJECTED = "rejected"


class RegistryUnavailable(RuntimeError):
    """MLflow could not be reached or answered with a server error (refused, timed out, 5xx, a locked
    database). The caller keeps what it has and retries later; "not found" is never this."""


def registered_model_name(base_model: str) -> str:
    """The registered model holding every drafter for `base_model` (a 16-lowercase-hex fingerprint)."""
    if not _FINGERPRINT.fullmatch(base_model):
        raise ValueError(f"base_model must be a base-model fingerprint of 16 lowercase hex digits, got {base_model!r}")
    return f"specloop-drafter-{base_model}"


def tau_tags(challenger: float, champion: float) -> dict[str, str]:
    """The two τ tags; `str(float)` is the shortest string that parses back to the same float."""
    return {Tag.TAU_CHALLENGER: str(float(challenger)), Tag.TAU_CHAMPION: str(float(champion))}


@dataclass(frozen=True)
class DrafterVersion:
    """One registered drafter, as MLflow reported it when it was looked up."""

    name: str
    version: str  # MLflow's version number, "1", "2", ...
    base_model: str
    run_id: str
    source: str  # the artifact URI of the version's `drafter/` folder
    tags: Mapping[str, str] = field(hash=False)
    aliases: tuple[str, ...]
    created_ms: int = 0  # when MLflow created the version, ms since the epoch

    def __post_init__(self) -> None:
        assert self.version.isdigit(), self.version
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))

    @property
    def label(self) -> str:
        """The `drafter_version` of metrics and traces."""
        return f"v{self.version}"

    @property
    def tau_challenger(self) -> float | None:
        return _float_tag(self.tags, Tag.TAU_CHALLENGER)

    @property
    def tau_champion(self) -> float | None:
        return _float_tag(self.tags, Tag.TAU_CHAMPION)

    @property
    def speed_over_suffix(self) -> float | None:
        """`Tag.SPEED_OVER_SUFFIX`, or None when no contest measured it (or a hand-set value does not parse)."""
        value = self.tags.get(Tag.SPEED_OVER_SUFFIX)
        return float(value) if value is not None and _is_finite_float(value) else None

    @property
    def benched(self) -> bool:
        """Whether the newest contest benched it (`Tag.BENCHED`); anything but "true" drafts."""
        return self.tags.get(Tag.BENCHED) == "true"

    @property
    def approval(self) -> Approval | None:
        value = self.tags.get(Tag.APPROVAL)
        return None if value is None else Approval(value)


class DrafterRegistry:
    """Drafter versions in one MLflow registry (`tracking_uri` is also the registry URI).

    `sqlite:///<file>`: artifacts go to `artifact_root`, by default `mlruns/` beside the file.
    `http(s)://<server>`: the server's artifact store is used, and every request gives up after
    `timeout_s` without retrying, raising `RegistryUnavailable`.
    """

    def __init__(self, tracking_uri: str, artifact_root: Path | str | None = None, timeout_s: int = 5,
                 on_serving_change: Callable[[str], None] | None = None) -> None:
        scheme = urlparse(tracking_uri).scheme
        if scheme not in ("sqlite", "http", "https"):
            raise ValueError(f"tracking_uri must be sqlite:///<file> or http(s)://<server>, got {tracking_uri!r}")
        if scheme != "sqlite" and artifact_root is not None:
            raise ValueError("artifact_root applies to a sqlite tracking_uri only; a server has its own artifact store")
        if not isinstance(timeout_s, int) or timeout_s < 1:  # MLflow reads the timeout as whole seconds
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, got {timeout_s!r}")
        self.tracking_uri = tracking_uri
        self._http = scheme != "sqlite"
        if not self._http:
            database = _sqlite_file(tracking_uri)
            artifact_root = database.with_name("mlruns") if artifact_root is None else artifact_root
        self._artifact_root = None if artifact_root is None else Path(artifact_root)
        self._timeout_s = timeout_s
        # Called with the base model after this registry moved or removed `champion`, or set a
        # version's `benched` tag: what engines serve changed (the daemon tells them at once).
        self.on_serving_change = on_serving_change
        self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    def register(self, artifact_dir: Path, base_model: str, tags: Mapping[str, str] = _NO_TAGS,
                 run_id: str | None = None) -> DrafterVersion:
        """Upload the artifact and make it the next version of `base_model`'s model, with every tag set
        in the one call that creates the version (a version is never seen half-tagged).

        With `run_id` (a `start_run` run: the training run with its params, metrics and dataset) the
        artifact goes into that run; otherwise into a run of its own."""
        name = registered_model_name(base_model)
        _check_artifact(Path(artifact_dir), base_model)
        version_tags = {**_checked_tags(tags, base_model), Tag.BASE_MODEL: base_model}
        if run_id is None:
            run_id = self.start_run(base_model, "register-drafter")
            source = self._log_artifact(run_id, Path(artifact_dir))
            self.end_run(run_id)
        else:
            source = self._log_artifact(run_id, Path(artifact_dir))
        self._create_registered_model(name, base_model)
        with self._calling():
            created = self._client.create_model_version(name, source, run_id, tags=version_tags)
        return self.version(base_model, str(created.version))  # the answer to create lacks its creation time

    def version(self, base_model: str, version: str) -> DrafterVersion:
        """The given version; ValueError when `base_model`'s model has no such version."""
        name = registered_model_name(base_model)
        with self._existing_version(name, version):
            found = self._client.get_model_version(name, version)
        return _drafter_version(found, base_model, tuple(found.aliases))

    def by_alias(self, base_model: str, alias: str) -> DrafterVersion | None:
        """The version behind `alias`, or None when the alias or the registered model does not exist."""
        model = self._registered_model(registered_model_name(base_model))
        if model is None or alias not in model.aliases:
            return None
        return self.version(base_model, str(model.aliases[alias]))

    def champion(self, base_model: str) -> DrafterVersion | None:
        return self.by_alias(base_model, CHAMPION)

    def versions(self, base_model: str) -> list[DrafterVersion]:
        """Every version of `base_model`'s model, oldest first; empty for an unknown base model."""
        name = registered_model_name(base_model)
        model = self._registered_model(name)
        if model is None:
            return []
        aliases: dict[str, list[str]] = {}
        for alias, version in model.aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        # Search results may leave aliases out ("for performance reasons", says MLflow), so they come
        # from the registered model.
        found = [_drafter_version(v, base_model, tuple(aliases.get(str(v.version), [])))
                 for v in self._search_versions(name)]
        return sorted(found, key=lambda v: int(v.version))

    def set_alias(self, base_model: str, alias: str, version: str) -> None:
        """Point `alias` at `version`, moving it if it points elsewhere."""
        name = registered_model_name(base_model)
        with self._existing_version(name, version):
            self._client.set_registered_model_alias(name, alias, version)
        if alias == CHAMPION:
            self._serving_changed(base_model)

    def delete_alias(self, base_model: str, alias: str) -> None:
        """Remove `alias`; nothing happens when it does not exist."""
        with self._tolerating(_NOT_FOUND):  # an unknown model; MLflow ignores an unknown alias itself
            self._client.delete_registered_model_alias(registered_model_name(base_model), alias)
        if alias == CHAMPION:
            self._serving_changed(base_model)

    def set_tags(self, base_model: str, version: str, tags: Mapping[str, str]) -> None:
        """Set (add or overwrite) tags on a version; MLflow has no batch call, so one request per tag."""
        name = registered_model_name(base_model)
        for key, value in _checked_tags(tags, base_model).items():
            with self._existing_version(name, version):
                self._client.set_model_version_tag(name, version, key, value)
        if Tag.BENCHED in tags:
            self._serving_changed(base_model)

    def _serving_changed(self, base_model: str) -> None:
        if self.on_serving_change is not None:
            self.on_serving_change(base_model)

    def download(self, v: DrafterVersion, dst: Path, max_bytes: int) -> Path:
        """The version's artifact directory under `dst/<name>/<version>-<run id>/`, downloaded once;
        ValueError when the version's files are missing, incomplete or together over `max_bytes`.

        Only the artifact's two files are fetched, and only once the store's listing says they fit:
        a registered version is untrusted input, and a hostile or broken one must not fill the disk of
        every engine that follows the alias. A download goes to a temp directory beside the target and
        is renamed into place when it holds both files, so an existing target is a complete download
        and is reused. The run id is in the name because version numbers restart in a new registry: a
        cache kept across one must not hand out another registry's v1.
        """
        target = Path(dst) / v.name / f"{v.version}-{v.run_id}"
        if not target.is_dir():
            self._download_into(v, target, max_bytes)
        _check_download(target, v)
        return target

    def _download_into(self, v: DrafterVersion, target: Path, max_bytes: int) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{v.version}.") as tmp:
            got = Path(tmp) / "artifact"
            got.mkdir()
            try:
                with self._calling():
                    listed = {Path(f.path).name: f.file_size for f in
                              mlflow.artifacts.list_artifacts(artifact_uri=v.source, tracking_uri=self.tracking_uri)}
                _check_listing(listed, v, max_bytes)
                for file in (WEIGHTS, CONFIG):
                    with self._calling():
                        mlflow.artifacts.download_artifacts(artifact_uri=f"{v.source.rstrip('/')}/{file}",
                                                            dst_path=str(got), tracking_uri=self.tracking_uri)
            except MlflowException as e:  # not a server error (that is RegistryUnavailable): the files are gone
                raise ValueError(f"version {v.label} of {v.name} ({v.source}) cannot be downloaded: {e.message}") from e
            _check_download(got, v)
            if sum(f.stat().st_size for f in got.iterdir()) > max_bytes:  # the listing may not know sizes
                raise ValueError(f"version {v.label} of {v.name}: its files hold more than {max_bytes} bytes")
            try:
                got.rename(target)
            except OSError:
                if not target.is_dir():  # otherwise a concurrent download of the same version won
                    raise

    def start_run(self, base_model: str, run_name: str, tags: Mapping[str, str] = _NO_TAGS) -> str:
        """A new MLflow run in the drafter experiment; its id."""
        experiment_id = self._experiment_id()  # its own calls: `_calling` holds a lock that is not reentrant
        with self._calling():
            run = self._client.create_run(experiment_id, tags={**tags, Tag.BASE_MODEL: base_model},
                                          run_name=run_name)
        return run.info.run_id

    def log_run(self, run_id: str, params: Mapping[str, object] = _NO_TAGS, metrics: Mapping[str, float] = _NO_TAGS,
                datasets: Sequence[DatasetInput] = ()) -> None:
        """Params, metrics (at step 0) and dataset inputs of a run, in one batch and one inputs call."""
        with self._calling():
            self._client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()],
                                   metrics=[Metric(k, float(v), _now_ms(), 0) for k, v in metrics.items()])
            if datasets:
                self._client.log_inputs(run_id, datasets=list(datasets))

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """FINISHED, FAILED or KILLED."""
        with self._calling():
            self._client.set_terminated(run_id, status)

    def _log_artifact(self, run_id: str, artifact_dir: Path) -> str:
        """The artifact's two files into the run's `drafter/` folder; that folder's artifact URI."""
        with self._calling():
            for file in (WEIGHTS, CONFIG):
                self._client.log_artifact(run_id, str(artifact_dir / file), ARTIFACT_PATH)
            artifact_uri = self._client.get_run(run_id).info.artifact_uri
        return f"{artifact_uri}/{ARTIFACT_PATH}"

    def _experiment_id(self) -> str:
        """The drafter experiment, created on first use: with the local artifact root for sqlite, so
        artifacts stay beside the database, and with the server's default store over http."""
        with self._calling():
            experiment = self._client.get_experiment_by_name(EXPERIMENT)
        if experiment is None:
            location = None if self._artifact_root is None else self._artifact_root.resolve().as_uri()
            with self._tolerating(_ALREADY_EXISTS):  # a concurrent register created it first
                self._client.create_experiment(EXPERIMENT, artifact_location=location)
            with self._calling():
                experiment = self._client.get_experiment_by_name(EXPERIMENT)
        return experiment.experiment_id

    def _create_registered_model(self, name: str, base_model: str) -> None:
        if self._registered_model(name) is None:
            with self._tolerating(_ALREADY_EXISTS):  # a concurrent register created it first
                self._client.create_registered_model(name, tags={Tag.BASE_MODEL: base_model})

    def _registered_model(self, name: str) -> RegisteredModel | None:
        model = None
        with self._tolerating(_NOT_FOUND):
            model = self._client.get_registered_model(name)
        return model

    def _search_versions(self, name: str) -> list[ModelVersion]:
        found: list[ModelVersion] = []
        token = None
        while True:
            with self._calling():
                page = self._client.search_model_versions(f"name = '{name}'", page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                return found

    @contextmanager
    def _existing_version(self, name: str, version: str) -> Iterator[None]:
        """A call on one version; its not existing is the caller's error."""
        try:
            with self._calling():
                yield
        except MlflowException as e:
            if e.error_code != _NOT_FOUND:
                raise
            raise ValueError(f"version {version!r} of {name} does not exist") from e

    @contextmanager
    def _tolerating(self, error_code: str) -> Iterator[None]:
        """A call whose MlflowException with `error_code` is an answer, not an error."""
        try:
            with self._calling():
                yield
        except MlflowException as e:
            if e.error_code != error_code:
                raise

    @contextmanager
    def _calling(self) -> Iterator[None]:
        """One or more MLflow calls, with this registry's HTTP limits, whose server errors become
        `RegistryUnavailable`. Client errors (not found, already exists, bad input) stay MlflowException."""
        try:
            with _http_limits(self._timeout_s) if self._http else nullcontext():
                yield
        except MlflowException as e:
            # MLflow reports a refused or timed-out request as INTERNAL_ERROR (500) and a locked
            # sqlite database as TEMPORARILY_UNAVAILABLE (503).
            if e.get_http_status_code() < 500:
                raise
            raise RegistryUnavailable(f"MLflow at {self.tracking_uri}: {e.message}") from e


# MLflow takes its HTTP timeout and retries only from environment variables, read on every request
# (mlflow/utils/rest_utils.py, `http_request`); `MlflowClient` has no such argument. Its default, 7
# retries with factor-2 backoff, holds a call to a down server for about 4 minutes (its own comment),
# where the engine wants an answer in seconds and retries on its own schedule. So the variables are
# set only for the duration of a registry call, under a lock: other threads' MLflow calls made
# meanwhile see them too, and registry calls over http in one process run one at a time.
_HTTP_ENV_LOCK = threading.RLock()  # a credentials block holds it around registry calls


def _http_limits(timeout_s: int) -> AbstractContextManager[None]:
    return mlflow_environment({MLFLOW_HTTP_REQUEST_TIMEOUT.name: str(timeout_s),
                               MLFLOW_HTTP_REQUEST_MAX_RETRIES.name: "0"})


@contextmanager
def mlflow_environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in this process's environment for the block, put back after. MLflow's client reads
    its limits and credentials (`MLFLOW_TRACKING_USERNAME`, ...) from the environment at each request,
    so a call made with other ones holds them there, one block at a time."""
    with _HTTP_ENV_LOCK:
        saved = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value


def _sqlite_file(tracking_uri: str) -> Path:
    """The database file of `sqlite:///relative` or `sqlite:////absolute`."""
    prefix = "sqlite:///"
    path = unquote(tracking_uri.removeprefix(prefix))
    if not tracking_uri.startswith(prefix) or not path or path == ":memory:":
        raise ValueError(f"tracking_uri must name a sqlite database file, got {tracking_uri!r}")
    return Path(path)


def _check_artifact(artifact_dir: Path, base_model: str) -> None:
    if not artifact_dir.is_dir():
        raise ValueError(f"artifact_dir {artifact_dir} is not a directory")
    for file in (WEIGHTS, CONFIG):
        if not (artifact_dir / file).is_file():
            raise ValueError(f"artifact_dir {artifact_dir} has no {file}")
    trained_for = json.loads((artifact_dir / CONFIG).read_text()).get(FINGERPRINT_KEY)
    if trained_for != base_model:
        raise ValueError(f"base_model {base_model} does not match the artifact's {FINGERPRINT_KEY} {trained_for!r} "
                         f"({artifact_dir / CONFIG})")


def add_reader(tracking_uri: str, username: str, password: str) -> str:
    """Create `username` on an MLflow server that runs its basic-auth app, or set its password if it
    exists; "created" or "updated". Run with the server's admin credentials (MLflow's own
    `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD`). What the user may do is the server's
    `default_permission`: with READ, as deploy/ configures it, it reads every drafter and writes none,
    which is what engines log in as (docs/deployment.md, "The registry's credentials")."""
    from mlflow.server import get_app_client

    if len(password) < _MIN_PASSWORD_CHARS:
        raise ValueError(f"the password must have at least {_MIN_PASSWORD_CHARS} characters")
    users = get_app_client("basic-auth", tracking_uri=tracking_uri)
    try:
        users.create_user(username, password)
        return "created"
    except MlflowException as e:
        if e.error_code != _ALREADY_EXISTS:
            raise
    users.update_user_password(username, password)
    return "updated"


def _check_listing(sizes: Mapping[str, int | None], v: DrafterVersion, max_bytes: int) -> None:
    """The store's listing of a version's artifact: both files there, and together within `max_bytes`."""
    if not sizes:
        raise ValueError(f"version {v.label} of {v.name} ({v.source}) cannot be downloaded: no files at its source")
    missing = [file for file in (WEIGHTS, CONFIG) if file not in sizes]
    if missing:
        raise ValueError(f"version {v.label} of {v.name} ({v.source}) lacks {', '.join(missing)}")
    listed = sum(sizes[file] or 0 for file in (WEIGHTS, CONFIG))
    if listed > max_bytes:
        raise ValueError(f"version {v.label} of {v.name}: its files hold {listed} bytes, more than a drafter "
                         f"of the served model can ({max_bytes})")


def _check_download(directory: Path, v: DrafterVersion) -> None:
    missing = [file for file in (WEIGHTS, CONFIG) if not (directory / file).is_file()]
    if missing:
        raise ValueError(f"version {v.label} of {v.name} ({v.source}) lacks {', '.join(missing)}")


def _checked_tags(tags: Mapping[str, str], base_model: str) -> dict[str, str]:
    """`tags` as a dict, refusing values the daemon and engine could not read back."""
    for key in (Tag.TAU_CHALLENGER, Tag.TAU_CHAMPION, Tag.TAU_CANARY, Tag.SPEED_OVER_SUFFIX):
        if key in tags and not _is_finite_float(tags[key]):
            raise ValueError(f"tags[{key!r}] must be a finite float as a string, got {tags[key]!r}")
    if tags.get(Tag.BENCHED, "false") not in ("true", "false"):
        raise ValueError(f"tags[{Tag.BENCHED!r}] must be 'true' or 'false', got {tags[Tag.BENCHED]!r}")
    approvals = [a.value for a in Approval]
    if tags.get(Tag.APPROVAL, Approval.PENDING) not in approvals:
        raise ValueError(f"tags[{Tag.APPROVAL!r}] must be one of {approvals}, got {tags[Tag.APPROVAL]!r}")
    if tags.get(Tag.BASE_MODEL, base_model) != base_model:
        raise ValueError(f"tags[{Tag.BASE_MODEL!r}] is {tags[Tag.BASE_MODEL]!r}, not this version's {base_model}")
    return {key: str(value) for key, value in tags.items()}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _is_finite_float(value: str) -> bool:
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def _float_tag(tags: Mapping[str, str], key: str) -> float | None:
    return None if key not in tags else float(tags[key])


def _drafter_version(v: ModelVersion, base_model: str, aliases: tuple[str, ...]) -> DrafterVersion:
    return DrafterVersion(name=v.name, version=str(v.version), base_model=base_model, run_id=v.run_id,
                          source=v.source, tags=dict(v.tags), aliases=tuple(sorted(aliases)),
                          created_ms=int(v.creation_timestamp or 0))

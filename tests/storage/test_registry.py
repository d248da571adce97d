"""The drafter registry against real MLflow on sqlite: names, versions, aliases, tags, downloads, and
a server that is not there.

A new sqlite database costs a few seconds of MLflow migrations, so most tests share one registry and
keep apart by using a fresh fingerprint each.
"""

import dataclasses
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import pytest
from mlflow import MlflowClient

from specloop.engine.speculation import drafter_artifact
from specloop.engine.speculation.drafter_artifact import Lineage, load_drafter, save_drafter
from specloop.storage.broker import free_port
from specloop.storage.registry import (
    CHALLENGER,
    CHAMPION,
    CONFIG,
    FINGERPRINT_KEY,
    WEIGHTS,
    Approval,
    DrafterRegistry,
    DrafterVersion,
    RegistryUnavailable,
    Tag,
    mlflow_environment,
    registered_model_name,
    tau_tags,
)
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


ANY_SIZE = 1 << 30  # bytes: bound enough for any test artifact


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> DrafterRegistry:
    return DrafterRegistry(f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")


@pytest.fixture
def fingerprint() -> str:
    return secrets.token_hex(8)


@pytest.fixture
def artifact(tmp_path: Path, fingerprint: str) -> Path:
    return make_artifact(tmp_path / "drafter", fingerprint)


def make_artifact(path: Path, fingerprint: str, seed: int = 1) -> Path:
    """A real drafter artifact, as training writes it, of a 2-layer drafter for a tiny target."""
    path = save_drafter(path, tiny_drafter(tiny_target(), seed=seed), fingerprint, Lineage("sha256:00", 1, seed))
    (path / "checkpoint.pt").write_bytes(b"resumable state that serving never reads")
    return path


def test_the_artifact_file_names_are_the_engines(artifact: Path, fingerprint: str) -> None:
    assert (WEIGHTS, CONFIG) == (drafter_artifact.WEIGHTS, drafter_artifact.CONFIG)
    assert drafter_artifact.read_meta(artifact)[FINGERPRINT_KEY] == fingerprint


def test_the_registered_model_is_named_after_the_fingerprint() -> None:
    assert registered_model_name("7d2a9147d6eef963") == "specloop-drafter-7d2a9147d6eef963"


@pytest.mark.parametrize("bad", ["", "7d2a9147", "7D2A9147D6EEF963", "7d2a9147d6eef9630", "7d2a9147d6eef96g", "fp-abc"])
def test_anything_but_a_fingerprint_is_refused(registry: DrafterRegistry, bad: str) -> None:
    with pytest.raises(ValueError, match="base_model"):
        registered_model_name(bad)
    with pytest.raises(ValueError, match="base_model"):
        registry.champion(bad)


def test_registering_twice_gives_versions_1_and_2_in_order(registry: DrafterRegistry, artifact: Path,
                                                           fingerprint: str, tmp_path: Path) -> None:
    first = registry.register(artifact, fingerprint, {Tag.DATASET: "sha256:aa", Tag.APPROVAL: Approval.PENDING})
    second = registry.register(make_artifact(tmp_path / "second", fingerprint, seed=2), fingerprint)

    assert [v.version for v in registry.versions(fingerprint)] == ["1", "2"]
    assert registry.versions(fingerprint) == [first, second]
    assert (first.name, first.base_model, first.label, first.aliases) == (
        registered_model_name(fingerprint), fingerprint, "v1", ())
    assert dict(first.tags) == {Tag.BASE_MODEL: fingerprint, Tag.DATASET: "sha256:aa", Tag.APPROVAL: "pending"}
    assert dict(second.tags) == {Tag.BASE_MODEL: fingerprint}
    assert first.approval is Approval.PENDING and second.approval is None
    assert first.run_id != second.run_id and first.source.endswith("/drafter")
    assert MlflowClient(registry.tracking_uri).get_run(first.run_id).data.tags[Tag.BASE_MODEL] == fingerprint
    with pytest.raises(TypeError):
        first.tags[Tag.GATE] = "pass"  # type: ignore[index]


def test_champion_is_none_before_any_alias_and_for_an_unknown_base_model(registry: DrafterRegistry, artifact: Path,
                                                                         fingerprint: str) -> None:
    assert registry.champion(fingerprint) is None
    assert registry.versions(fingerprint) == []
    registry.register(artifact, fingerprint)

    assert registry.champion(fingerprint) is None
    assert registry.by_alias(fingerprint, CHALLENGER) is None


def test_aliases_are_set_moved_and_deleted(registry: DrafterRegistry, artifact: Path, fingerprint: str) -> None:
    v1 = registry.register(artifact, fingerprint)
    v2 = registry.register(artifact, fingerprint)

    registry.set_alias(fingerprint, CHAMPION, v1.version)
    registry.set_alias(fingerprint, CHALLENGER, v2.version)
    assert registry.champion(fingerprint) == _with_aliases(v1, CHAMPION)
    assert registry.by_alias(fingerprint, CHALLENGER) == _with_aliases(v2, CHALLENGER)

    registry.set_alias(fingerprint, CHAMPION, v2.version)
    assert registry.champion(fingerprint) == _with_aliases(v2, CHALLENGER, CHAMPION)
    assert [v.aliases for v in registry.versions(fingerprint)] == [(), (CHALLENGER, CHAMPION)]

    registry.delete_alias(fingerprint, CHAMPION)
    registry.delete_alias(fingerprint, CHAMPION)
    registry.delete_alias(secrets.token_hex(8), CHAMPION)
    assert registry.champion(fingerprint) is None
    assert registry.by_alias(fingerprint, CHALLENGER) == _with_aliases(v2, CHALLENGER)


def test_what_engines_serve_changing_is_announced(registry: DrafterRegistry, artifact: Path, fingerprint: str) -> None:
    """Moving or removing `champion` and setting `benched` announce; other aliases and tags do not."""
    v1 = registry.register(artifact, fingerprint)
    heard: list[str] = []
    registry.on_serving_change = heard.append
    try:
        registry.set_alias(fingerprint, CHALLENGER, v1.version)
        registry.set_tags(fingerprint, v1.version, {Tag.APPROVAL: Approval.PENDING})
        assert heard == []
        registry.set_alias(fingerprint, CHAMPION, v1.version)
        registry.set_tags(fingerprint, v1.version, {Tag.BENCHED: "true"})
        registry.delete_alias(fingerprint, CHAMPION)
        assert heard == [fingerprint] * 3
    finally:
        registry.on_serving_change = None


def _with_aliases(v: DrafterVersion, *aliases: str) -> DrafterVersion:
    return dataclasses.replace(v, aliases=aliases)


def test_tags_are_set_typed_and_checked(registry: DrafterRegistry, artifact: Path, fingerprint: str) -> None:
    v = registry.register(artifact, fingerprint)
    tau = 0.1 + 0.2  # 0.30000000000000004: only a repr-exact string gets it back

    registry.set_tags(fingerprint, v.version, {**tau_tags(tau, 2.5), Tag.APPROVAL: Approval.APPROVED})
    tagged = registry.version(fingerprint, v.version)

    assert (tagged.tau_challenger, tagged.tau_champion, tagged.approval) == (tau, 2.5, Approval.APPROVED)
    for bad in ({Tag.APPROVAL: "maybe"}, {Tag.TAU_CHAMPION: "nan"}, {Tag.TAU_CHALLENGER: "high"},
                {Tag.BASE_MODEL: secrets.token_hex(8)}):
        with pytest.raises(ValueError, match="tags"):
            registry.set_tags(fingerprint, v.version, bad)
    assert registry.version(fingerprint, v.version).tags == tagged.tags


def test_an_unknown_version_is_refused(registry: DrafterRegistry, artifact: Path, fingerprint: str) -> None:
    registry.register(artifact, fingerprint)
    with pytest.raises(ValueError, match="version '7'"):
        registry.version(fingerprint, "7")
    with pytest.raises(ValueError, match="version '7'"):
        registry.set_alias(fingerprint, CHAMPION, "7")
    with pytest.raises(ValueError, match="version '7'"):
        registry.set_tags(fingerprint, "7", {Tag.GATE: "pass"})


def test_download_round_trips_the_bytes_and_reuses_a_complete_download(registry: DrafterRegistry, artifact: Path,
                                                                        fingerprint: str, tmp_path: Path) -> None:
    v = registry.register(artifact, fingerprint)

    got = registry.download(v, tmp_path / "cache", ANY_SIZE)

    assert got == tmp_path / "cache" / v.name / f"{v.version}-{v.run_id}"
    assert sorted(p.name for p in got.iterdir()) == ["drafter.json", "model.safetensors"]  # no checkpoint.pt
    for name in ("drafter.json", "model.safetensors"):
        assert (got / name).read_bytes() == (artifact / name).read_bytes()
    assert load_drafter(got, fingerprint).fingerprint == fingerprint
    assert os.listdir(got.parent) == [got.name]  # no temp directory left beside it
    mtime = (got / "model.safetensors").stat().st_mtime_ns
    assert registry.download(v, tmp_path / "cache", ANY_SIZE) == got
    assert (got / "model.safetensors").stat().st_mtime_ns == mtime


def test_concurrent_registers_and_downloads_both_succeed(registry: DrafterRegistry, artifact: Path,
                                                         fingerprint: str, tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        registered = list(pool.map(lambda _: registry.register(artifact, fingerprint), range(2)))
        assert sorted(v.version for v in registered) == ["1", "2"]
        got = list(pool.map(lambda _: registry.download(registered[0], tmp_path / "cache", ANY_SIZE), range(2)))

    assert got[0] == got[1] and (got[0] / "model.safetensors").read_bytes() == (artifact / WEIGHTS).read_bytes()
    assert os.listdir(got[0].parent) == [got[0].name]  # one download, no temp directory left


def test_a_version_larger_than_the_bound_is_refused_before_its_files_are_fetched(
        registry: DrafterRegistry, artifact: Path, fingerprint: str, tmp_path: Path) -> None:
    v = registry.register(artifact, fingerprint)
    size = sum((artifact / name).stat().st_size for name in (WEIGHTS, "drafter.json"))

    with pytest.raises(ValueError, match=rf"its files hold {size} bytes, more than a drafter of the served model "
                                         rf"can \({size - 1}\)"):
        registry.download(v, tmp_path / "cache", size - 1)
    assert not (tmp_path / "cache" / v.name).exists() or not any((tmp_path / "cache" / v.name).iterdir())
    assert registry.download(v, tmp_path / "cache", size).is_dir()


def test_only_the_artifacts_two_files_are_fetched(registry: DrafterRegistry, artifact: Path, fingerprint: str,
                                                  tmp_path: Path) -> None:
    v = registry.register(artifact, fingerprint)
    (Path(urlparse(v.source).path) / "huge.bin").write_bytes(b"x" * 4096)

    got = registry.download(v, tmp_path / "cache", 1 << 30)

    assert sorted(p.name for p in got.iterdir()) == ["drafter.json", "model.safetensors"]


def test_a_download_lacking_the_weights_is_refused(registry: DrafterRegistry, fingerprint: str, tmp_path: Path) -> None:
    client = MlflowClient(registry.tracking_uri, registry.tracking_uri)
    experiment = client.create_experiment(f"broken-{fingerprint}", artifact_location=(tmp_path / "runs").as_uri())
    run = client.create_run(experiment)
    (tmp_path / "drafter.json").write_text(json.dumps({"base_model_fingerprint": fingerprint}))
    client.log_artifact(run.info.run_id, str(tmp_path / "drafter.json"), "drafter")
    name = registered_model_name(fingerprint)
    client.create_registered_model(name)
    client.create_model_version(name, f"{run.info.artifact_uri}/drafter", run.info.run_id)

    with pytest.raises(ValueError, match=r"version v1 .* lacks model\.safetensors"):
        registry.download(registry.version(fingerprint, "1"), tmp_path / "cache", ANY_SIZE)
    assert not (tmp_path / "cache" / name / "1").exists()


def test_a_version_whose_files_are_gone_is_refused(registry: DrafterRegistry, artifact: Path, fingerprint: str,
                                                   tmp_path: Path) -> None:
    v = registry.register(artifact, fingerprint)
    shutil.rmtree(urlparse(v.source).path)

    with pytest.raises(ValueError, match=r"version v1 .* cannot be downloaded"):
        registry.download(v, tmp_path / "cache", ANY_SIZE)
    assert not (tmp_path / "cache" / v.name / v.version).exists()


@pytest.mark.parametrize("damage, match", [
    ("missing directory", "is not a directory"),
    ("no weights", "has no model.safetensors"),
    ("no config", "has no drafter.json"),
    ("other fingerprint", "base_model .* does not match"),
])
def test_register_refuses_what_is_not_this_base_models_artifact(registry: DrafterRegistry, artifact: Path,
                                                                fingerprint: str, damage: str, match: str) -> None:
    base_model = fingerprint
    if damage == "missing directory":
        artifact = artifact / "absent"
    elif damage == "no weights":
        (artifact / "model.safetensors").unlink()
    elif damage == "no config":
        (artifact / "drafter.json").unlink()
    else:
        base_model = secrets.token_hex(8)

    with pytest.raises(ValueError, match=match):
        registry.register(artifact, base_model)
    assert registry.versions(base_model) == []


def test_two_registries_in_one_process_do_not_mix(registry: DrafterRegistry, tmp_path: Path, artifact: Path,
                                                  fingerprint: str) -> None:
    other = DrafterRegistry(f"sqlite:///{tmp_path / 'other.db'}", artifact_root=tmp_path / "other-artifacts")

    registry.register(artifact, fingerprint, {Tag.GATE: "first"})
    assert other.versions(fingerprint) == []
    other.register(artifact, fingerprint, {Tag.GATE: "other"})
    other.register(artifact, fingerprint, {Tag.GATE: "other"})
    registry.set_alias(fingerprint, CHAMPION, "1")

    ours, theirs = registry.versions(fingerprint), other.versions(fingerprint)
    assert [v.tags[Tag.GATE] for v in ours] == ["first"] and [v.tags[Tag.GATE] for v in theirs] == ["other"] * 2
    assert other.champion(fingerprint) is None
    default_root = Path(registry.tracking_uri.removeprefix("sqlite:///")).with_name("mlruns")  # beside the file
    assert Path(urlparse(ours[0].source).path).is_relative_to(default_root)
    assert all(Path(urlparse(v.source).path).is_relative_to(tmp_path / "other-artifacts") for v in theirs)
    assert mlflow.get_tracking_uri() not in (registry.tracking_uri, other.tracking_uri)


def test_a_closed_port_is_unavailable_at_once(artifact: Path, fingerprint: str) -> None:
    registry = DrafterRegistry(f"http://127.0.0.1:{free_port()}")
    environ = dict(os.environ)

    for call in (lambda: registry.champion(fingerprint), lambda: registry.versions(fingerprint),
                 lambda: registry.register(artifact, fingerprint)):
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="Connection refused"):
            call()
        assert time.monotonic() - started < 15
    assert dict(os.environ) == environ


def test_credentials_held_around_registry_calls_are_put_back(artifact: Path, fingerprint: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of other credentials (the fleet seeds as the admin) nests the calls' own limits in it,
    on one thread, and leaves the environment as it found it."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "engine")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    environ = dict(os.environ)
    registry = DrafterRegistry(f"http://127.0.0.1:{free_port()}")
    with mlflow_environment({"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "p" * 16}):
        with pytest.raises(RegistryUnavailable):
            registry.champion(fingerprint)  # holds the limits inside the block
        assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("admin", "p" * 16)
    assert dict(os.environ) == environ


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_a_server_that_does_not_answer_is_unavailable_after_the_timeout(silent_port: int, fingerprint: str) -> None:
    registry = DrafterRegistry(f"http://127.0.0.1:{silent_port}", timeout_s=1)

    started = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="timeout|timed out"):
        registry.champion(fingerprint)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("kwargs, match", [
    ({"tracking_uri": "file:///tmp/mlruns"}, "tracking_uri"),
    ({"tracking_uri": "postgresql://db/mlflow"}, "tracking_uri"),
    ({"tracking_uri": "sqlite://"}, "tracking_uri"),
    ({"tracking_uri": "http://mlflow:5000", "artifact_root": "/tmp/x"}, "artifact_root"),
    ({"tracking_uri": "http://mlflow:5000", "timeout_s": 0}, "timeout_s"),
    ({"tracking_uri": "http://mlflow:5000", "timeout_s": 2.5}, "timeout_s"),
])
def test_a_bad_configuration_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DrafterRegistry(**kwargs)

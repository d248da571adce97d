"""The registry contract against a real MLflow tracking server (`mlflow server`, its own process,
artifacts proxied by the server): the same code the embedded SQLite registry runs, over HTTP."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from mlflow.exceptions import MlflowException

from specloop.daemon.child_command import specloop_command
from specloop.engine.speculation.drafter_artifact import Lineage, load_drafter, save_drafter
from specloop.storage.broker import free_port
from specloop.storage.child_process import die_with_parent
from specloop.storage.registry import CHAMPION, DrafterRegistry
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FINGERPRINT = "7777777777777777"
ADMIN = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "admin-password-for-tests-0123"}
READER = {"MLFLOW_TRACKING_USERNAME": "engine", "MLFLOW_TRACKING_PASSWORD": "engine-password-for-tests-0123"}
ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def mlflow_server(root: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`mlflow server` on a free port over a SQLite store in `root`, artifacts served by it; its URL."""
    port = free_port()
    command = [sys.executable, "-P", "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
               str(root / "artifacts"), "--workers", "1", *args]
    with open(root / "server.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
                                   env={**os.environ, **(env or {})}, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)


# These tests check round trips and permissions, not latency: in a full `make test` on 2 cores the basic-auth
# server once took over the registry's default 5 s to answer the admin's first registration.
PATIENT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """With MLflow's basic-auth app as deploy/ runs it, its configuration file included: every user reads,
    only the admin writes what it made."""
    root = tmp_path_factory.mktemp("mlflow-auth")
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ROOT / "deploy" / "mlflow-auth.ini"),
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "f" * 32, "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN["MLFLOW_TRACKING_PASSWORD"]}
    with mlflow_server(root, "--app-name", "basic-auth", env=env) as url:
        yield url


def test_register_alias_and_download_over_http(server: str, tmp_path: Path) -> None:
    registry = DrafterRegistry(server, timeout_s=PATIENT_S)
    artifact = save_drafter(tmp_path / "d", tiny_drafter(tiny_target()), FINGERPRINT, Lineage("sha256:x", 3, 1))
    v1 = registry.register(artifact, FINGERPRINT, {"dataset": "sha256:x"})
    v2 = registry.register(artifact, FINGERPRINT)
    assert (v1.version, v2.version) == ("1", "2") and v1.tags["dataset"] == "sha256:x"
    assert registry.champion(FINGERPRINT) is None

    registry.set_alias(FINGERPRINT, CHAMPION, v2.version)
    champion = registry.champion(FINGERPRINT)
    got = registry.download(champion, tmp_path / "cache", 1 << 30)

    assert (champion.version, champion.aliases) == ("2", (CHAMPION,))
    assert (got / "model.safetensors").read_bytes() == (artifact / "model.safetensors").read_bytes()
    assert load_drafter(got, FINGERPRINT).lineage == Lineage("sha256:x", 3, 1)
    assert [v.version for v in registry.versions(FINGERPRINT)] == ["1", "2"]


def test_engines_read_with_read_only_credentials_and_cannot_write(auth_server: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ADMIN.items():
        monkeypatch.setenv(key, value)
    artifact = save_drafter(tmp_path / "d", tiny_drafter(tiny_target()), FINGERPRINT, Lineage("sha256:x", 3, 1))
    admin = DrafterRegistry(auth_server, timeout_s=PATIENT_S)
    v1 = admin.register(artifact, FINGERPRINT)
    admin.set_alias(FINGERPRINT, CHAMPION, v1.version)
    setup = {**os.environ, "SPECLOOP_REGISTRY": auth_server,
             "SPECLOOP_REGISTRY_READER_PASSWORD": READER["MLFLOW_TRACKING_PASSWORD"]}
    for expected in ("created", "updated"):  # run again, it only sets the password
        run = subprocess.run(specloop_command("registry", "add-reader", "--username", "engine"), env=setup,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and f"registry user engine {expected}" in run.stdout, run.stderr[-2000:]

    for key, value in READER.items():
        monkeypatch.setenv(key, value)
    engine = DrafterRegistry(auth_server, timeout_s=PATIENT_S)
    champion = engine.champion(FINGERPRINT)
    assert champion.version == v1.version
    assert load_drafter(engine.download(champion, tmp_path / "cache", 1 << 30), FINGERPRINT).fingerprint == FINGERPRINT
    with pytest.raises(MlflowException, match="403"):
        engine.set_alias(FINGERPRINT, CHAMPION, v1.version)
    with pytest.raises(MlflowException, match="403"):
        engine.register(artifact, FINGERPRINT)

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password-0123456789")
    with pytest.raises(MlflowException, match="401"):
        DrafterRegistry(auth_server, timeout_s=PATIENT_S).champion(FINGERPRINT)

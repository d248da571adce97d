"""The registry contract against a real MLflow tracking server (`mlflow server`, its own process,
artifacts proxied by the server): the same code the embedded SQLite registry runs, over HTTP."""

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specloop.engine.speculation.drafter_artifact import Lineage, load_drafter, save_drafter
from specloop.storage.broker import free_port
from specloop.storage.child_process import die_with_parent
from specloop.storage.registry import CHAMPION, DrafterRegistry
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FINGERPRINT = "7777777777777777"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
               str(root / "artifacts"), "--workers", "1"]
    with open(root / "server.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
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


def test_register_alias_and_download_over_http(server: str, tmp_path: Path) -> None:
    registry = DrafterRegistry(server)
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

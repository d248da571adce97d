"""`specloop up` as `make run` starts it: broker, sink and server come up, a consented request ends
as a Parquet row once the stack is stopped with SIGTERM, and no child process outlives it."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import wait_ready
from specloop.storage.broker import free_port
from specloop.storage.layout import live_files
from tests.integration.conftest import ACME_KEY, TENANTS_YAML

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_captures_and_stops_everything(tiny_llama_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tenants.yaml").write_text(TENANTS_YAML)
    env = {**os.environ, "SPECLOOP_DATA_DIR": str(tmp_path / "data"),
           "SPECLOOP_TENANTS_FILE": str(tmp_path / "tenants.yaml"), "SPECLOOP_DTYPE": "float32",
           "SPECLOOP_DEVICE": "cpu", "SPECLOOP_MAX_LEN": "256", "SPECLOOP_NUM_SLOTS": "2"}
    port, log = free_port(), tmp_path / "up.log"
    specloop = Path(sys.executable).parent / "specloop"
    with open(log, "wb") as out:
        up = subprocess.Popen([str(specloop), "up", "--model", str(tiny_llama_dir), "--port", str(port)], env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    children, broker_port = [], None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, up, log, 90)
        children = [int(p) for p in re.findall(r"sink \(pid (\d+)\)", log.read_text())]
        broker_port = int(re.search(r"tansu \(memory storage\) on 127.0.0.1:(\d+)", log.read_text()).group(1))
        admin = (tmp_path / "data" / "consent-secrets.json").read_text()
        token = re.search(r'"admin_token": "([^"]+)"', admin).group(1)
        grant = httpx.post(f"{url}/admin/consents", json={"tenant": "acme", "user": "alice"},
                           headers={"Authorization": f"Bearer {token}"})
        assert grant.status_code == 201, grant.text
        body = {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "user": "alice"}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {ACME_KEY}"})
        assert r.status_code == 200, r.text
        # The embedded registry was seeded with the shipped drafter, which is SmolLM2's: the tiny model
        # served here has no champion, so it drafts with n-gram lookup alone.
        assert "registry seeded: shipped drafter" in log.read_text()
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"] is None
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert children and not any(_alive(pid) for pid in children), log.read_text()
    with pytest.raises(OSError):  # the broker is gone too
        socket.create_connection(("127.0.0.1", broker_port), timeout=1).close()
    files = live_files(tmp_path / "data" / "traces")
    assert len(files) == 1 and "base_model=" in str(files[0]), log.read_text()

"""`specloop up` on its defaults (`make run` adds `--demo` traffic): the real SmolLM2 from its GGUF's
own blocks (weights `auto`; bf16 where the CPU kernels did not build or built portably), drafting
with the shipped DFlash drafter (with suffix decoding) that seeded the embedded registry as v1, with
the retraining daemon and the MLflow UI beside it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import wait_ready
from specloop.engine.loaders.load import own_formats_served
from specloop.storage.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_up_drafts_with_the_shipped_drafter_from_its_first_start(tmp_path: Path) -> None:
    env = {**os.environ, "SPECLOOP_DATA_DIR": str(tmp_path / "data"), "SPECLOOP_NUM_SLOTS": "2",
           "SPECLOOP_MAX_LEN": "512"}
    port, mlflow_port, daemon_port, log = free_port(), free_port(), free_port(), tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "specloop"), "up", "--port", str(port),
                               "--mlflow-port", str(mlflow_port), "--daemon-port", str(daemon_port)], env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, up, log, 240)
        deadline = time.monotonic() + 60
        while (card := httpx.get(f"{url}/v1/models").json()["data"][0])["drafter_version"] != "v1":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert card["weights"] == ("gguf" if own_formats_served() else "dense")
        body = {"model": card["id"], "messages": [{"role": "user", "content": "Write a Python function that adds "
                                                                               "two numbers."}],
                "max_tokens": 48, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["speculation"]["drafts"] > 0
        metrics = httpx.get(f"{url}/metrics").text
        assert 'specloop_spec_decode_num_drafts_total{drafter_version="v1"}' in metrics
        # The retraining daemon (default policy) and the MLflow UI run beside it.
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{daemon_port}/health").json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        assert health["status"] == "ok" and health["base_model"] == card["fingerprint"] and health["next_tick"]
        assert httpx.get(f"http://127.0.0.1:{mlflow_port}/health", timeout=30).status_code == 200
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()

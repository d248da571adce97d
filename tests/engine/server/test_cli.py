"""`specloop serve` as a user runs it: a subprocess that serves, answers, and exits cleanly on SIGTERM."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from benchmarks.server_process import wait_ready
from specloop.engine.loaders.load import load_model
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.storage.broker import free_port

pytestmark = pytest.mark.timeout(120)


def test_serve_answers_then_shuts_down_gracefully(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    specloop = Path(sys.executable).parent / "specloop"
    env = {**os.environ, "SPECLOOP_NUM_SLOTS": "2"}
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([str(specloop), "serve", "--model", str(tiny_llama_dir), "--port", str(port),
                                 "--dtype", "float32", "--device", "cpu", "--max-len", "128"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, tmp_path / "serve.log", 90)
            body = {"model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
            assert httpx.post(f"{base}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
            assert "specloop_kv_cache_slots_total 2.0" in httpx.get(f"{base}/metrics").text
            proc.send_signal(signal.SIGTERM)
            # uvicorn re-raises the signal after its graceful shutdown, so the status reports it.
            assert proc.wait(timeout=30) == -signal.SIGTERM
            log_text = (tmp_path / "serve.log").read_text()
            assert "Application shutdown complete" in log_text and "engine stopped" in log_text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_serve_nvfp4_weights_as_another_base_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    specloop = Path(sys.executable).parent / "specloop"
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([str(specloop), "serve", "--model", str(tiny_llama_dir), "--port", str(port),
                                 "--dtype", "bfloat16", "--device", "cpu", "--max-len", "128", "--weights", "nvfp4",
                                 "--nvfp4-lm-head", "--nvfp4-embedding"], stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, tmp_path / "serve.log", 90)
            card = httpx.get(f"{base}/v1/models").json()["data"][0]
            dense = load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu")).fingerprint
            assert card["weights"] == "nvfp4" and card["quantized_from"] == dense != card["fingerprint"]
            assert card["nvfp4_lm_head"] is card["nvfp4_embedding"] is True
            fmt = WeightFormat("nvfp4", lm_head=True, embedding=True)
            assert card["fingerprint"] == load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu"),
                                                     fmt).fingerprint
            body = {"model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
            assert httpx.post(f"{base}/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
        finally:
            proc.kill()
            proc.wait()


def test_serve_gguf_blocks_as_the_same_base_model(tmp_path: Path) -> None:
    """The shipped GGUF served from its own blocks: the file's fingerprint, as the dense load has."""
    port = free_port()
    specloop = Path(sys.executable).parent / "specloop"
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([str(specloop), "serve", "--port", str(port), "--device", "cpu", "--max-len", "256",
                                 "--weights", "gguf"], stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc, tmp_path / "serve.log", 90)
            card = httpx.get(f"{base}/v1/models").json()["data"][0]
            assert card["weights"] == "gguf" and card["fingerprint"] == "7d2a9147d6eef963"
            body = {"model": card["id"], "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
            assert reply["system_fingerprint"] == "7d2a9147d6eef963" and reply["usage"]["completion_tokens"] >= 1
        finally:
            proc.kill()
            proc.wait()


def test_serve_refuses_bad_options_naming_them() -> None:
    specloop = Path(sys.executable).parent / "specloop"
    r = subprocess.run([str(specloop), "serve", "--dtype", "float16"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "dtype" in r.stderr
    r = subprocess.run([str(specloop), "serve", "--weights", "int4"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "weights" in r.stderr
    r = subprocess.run([str(specloop), "serve", "--nvfp4-embedding"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "nvfp4_embedding: Value error, an NVFP4 part needs weights 'nvfp4'" in " ".join(
        r.stderr.replace("│", " ").split())

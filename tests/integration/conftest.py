"""Fixtures for the end-to-end capture tests: a real server with capture wired as `specloop serve` does.

`capture_stack(...)` serves the tiny random Llama (`tests/model_fixtures.py`) with n-gram
speculation behind a real uvicorn, through `specloop.engine.server.cli.serving_app` (the same wiring as the CLI:
tenants, consent registry, capture policy, Kafka producer, admin API), pointed at the session's
real tansu broker, with a real `TraceSink` thread writing Parquet. Nothing is mocked.
"""

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.settings import ConsentConfig, ConsentSettings
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.llm_engine import LLMEngine
from specloop.engine.server.cli import serving_app
from specloop.engine.server.settings import ServerSettings
from specloop.engine.speculation.ngram import NgramProposer
from specloop.storage.broker import EmbeddedBroker, ensure_topics
from specloop.storage.sink import SinkConfig, TraceSink
from tests.engine.server.conftest import tiny_loaded  # noqa: F401  (fixtures, used by name)
from tests.server_thread import serve_in_thread

ACME_KEY = "acme-key-0123456789abcdef"  # tenant that allows capture
INITECH_KEY = "initech-key-0123456789abcd"  # tenant that never allows capture
TENANTS_YAML = f"""
allow_anonymous: true
tenants:
  - name: acme
    api_keys: ["{ACME_KEY}"]
    capture_allowed: true
    policy_version: "2026-01"
  - name: initech
    api_keys: ["{INITECH_KEY}"]
    capture_allowed: false
"""


@dataclass
class CaptureStack:
    """A served model with capture on; `consent` is the resolved config the server runs with."""

    base_url: str
    loaded: LoadedModel
    consent: ConsentConfig
    topic: str
    bootstrap: str

    @property
    def model(self) -> str:
        return self.loaded.name

    def subject(self, tenant: str, user: str) -> str:
        return Pseudonymizer(self.consent.hmac_key).subject(tenant, user)

    def admin(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.base_url}/admin{path}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {self.consent.admin_token}"})

    def chat(self, text: str, key: str | None = ACME_KEY, user: str | None = None, max_tokens: int = 8,
             headers: dict[str, str] | None = None) -> httpx.Response:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, **({"user": user} if user else {})}
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.base_url}/v1/chat/completions", json=body, headers={**auth, **(headers or {})},
                          timeout=30)

    def metric(self, line_prefix: str) -> float:
        """The value of the first /metrics sample starting with `line_prefix` (0 when absent)."""
        for line in httpx.get(f"{self.base_url}/metrics", timeout=10).text.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def consent_settings(data_dir: Path, tenants_yaml: str | None) -> ConsentSettings:
    tenants_file = None
    if tenants_yaml is not None:
        tenants_file = data_dir / "tenants.yaml"
        tenants_file.parent.mkdir(parents=True, exist_ok=True)
        tenants_file.write_text(tenants_yaml)
    return ConsentSettings(data_dir=data_dir, tenants_file=tenants_file, hmac_key=SecretStr(uuid.uuid4().hex * 2),
                           admin_token=SecretStr(uuid.uuid4().hex * 2))


@contextmanager
def serving(loaded: LoadedModel, settings: ServerSettings, consent: ConsentSettings) -> Iterator[tuple[str, FastAPI]]:
    """The app `specloop serve` would build, behind a real uvicorn: (base URL, app)."""
    engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids,
                       NgramProposer(block_size=4))
    app = serving_app(settings, loaded, engine, consent)
    with serve_in_thread(app) as url:
        yield url, app


def server_settings(**capture: object) -> ServerSettings:
    return ServerSettings(max_len=256, num_slots=4, dtype="float32", device="cpu", **capture)


@contextmanager
def running_sink(config: SinkConfig) -> Iterator[None]:
    stop = threading.Event()
    sink = TraceSink(config, registry=CollectorRegistry())
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture(scope="module")
def stack(broker: EmbeddedBroker, tiny_loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[CaptureStack]:
    topic = f"traces-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap_servers, {topic: 3, f"{topic}.dlq": 1})
    consent = consent_settings(tmp_path_factory.mktemp("data"), TENANTS_YAML)
    resolved = consent.resolve()
    sink = SinkConfig(bootstrap_servers=broker.bootstrap_servers, root=resolved.traces_root, topic=topic,
                      group_id=f"sink-{topic}", dead_letter_topic=f"{topic}.dlq", flush_records=1_000,
                      flush_interval_s=0.5)
    settings = server_settings(kafka_bootstrap=broker.bootstrap_servers, kafka_topic=topic, capture_flush_s=5)
    with running_sink(sink), serving(tiny_loaded, settings, consent) as (url, _):
        yield CaptureStack(url, tiny_loaded, resolved, topic, broker.bootstrap_servers)


@dataclass
class RegistryWiring:
    """A fresh trace topic with its sink, and server settings that capture to it and follow a registry."""

    consent: ConsentSettings
    resolved: ConsentConfig
    sink: SinkConfig
    settings: ServerSettings

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.resolved.admin_token}"}


def registry_wiring(broker: EmbeddedBroker, tmp_path: Path, registry_uri: str, poll_s: float) -> RegistryWiring:
    topic = f"traces-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap_servers, {topic: 3, f"{topic}.dlq": 1})
    consent = consent_settings(tmp_path / "data", TENANTS_YAML)
    resolved = consent.resolve()
    sink = SinkConfig(bootstrap_servers=broker.bootstrap_servers, root=resolved.traces_root, topic=topic,
                      group_id=f"sink-{topic}", dead_letter_topic=f"{topic}.dlq", flush_records=1_000,
                      flush_interval_s=0.5)
    settings = server_settings(kafka_bootstrap=broker.bootstrap_servers, kafka_topic=topic, capture_flush_s=5,
                               registry=registry_uri, registry_poll_s=poll_s, proposer="combined",
                               drafter_cache_dir=tmp_path / "cache")
    return RegistryWiring(consent, resolved, sink, settings)

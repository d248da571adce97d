"""Fixtures for the API tests: a tiny random Llama served by a real uvicorn on a free loopback port.

The model is `tests/model_fixtures.py`'s `tiny_llama_dir` (real files, a real byte-level BPE
tokenizer and ChatML template), so prompts, multi-byte characters and special tokens behave as
in production while a decode step takes about a millisecond.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from specloop.consent.tenants import TenantDirectory
from specloop.engine.loaders.load import LoadedModel, load_model
from specloop.engine.runtime.llm_engine import LLMEngine
from specloop.engine.server.api import build_app
from specloop.engine.server.serving import FinishedRequest
from specloop.engine.server.settings import ServerSettings
from specloop.engine.speculation.ngram import NgramProposer
from specloop.engine.speculation.proposer import Proposer
from tests.server_thread import serve_in_thread

MAX_LEN = 256  # the tiny model's max_position_embeddings
NUM_SLOTS = 4


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))


@dataclass
class FinishHookSpy:
    """Collects finished requests; `fail` makes the hook raise, as a broken trace producer would."""

    calls: list[FinishedRequest] = field(default_factory=list)
    fail: bool = False

    def __call__(self, finished: FinishedRequest) -> None:
        self.calls.append(finished)
        if self.fail:
            raise RuntimeError("trace producer is down")


@dataclass
class RunningServer:
    base_url: str
    engine: LLMEngine
    loaded: LoadedModel
    hook: FinishHookSpy

    @property
    def model(self) -> str:
        return self.loaded.name

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no sequence holds a slot or waits for one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.slots_used == 0 and s.running == 0 and s.waiting == 0:
                return True
            time.sleep(0.02)
        return False


@contextmanager
def serving(loaded: LoadedModel, proposer: Proposer | None, tenants: TenantDirectory | None = None,
            send_buffer: int | None = None, **overrides: object) -> Iterator[RunningServer]:
    """An engine behind a real uvicorn for `loaded` (the app's lifespan starts and stops the engine);
    `overrides` are `ServerSettings` fields (limits), `send_buffer` each connection's (`serve_in_thread`)."""
    settings = ServerSettings(**{"max_len": MAX_LEN, "num_slots": NUM_SLOTS, "dtype": "float32", "device": "cpu",
                                 **overrides})
    engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids, proposer)
    hook = FinishHookSpy()
    app = build_app(loaded, engine, settings, on_finish=hook, tenants=tenants)
    with serve_in_thread(app, send_buffer=send_buffer) as url:
        yield RunningServer(url, engine, loaded, hook)


@pytest.fixture(scope="module")
def server(tiny_loaded: LoadedModel) -> Iterator[RunningServer]:
    with serving(tiny_loaded, None) as running:
        yield running


@pytest.fixture(scope="module")
def spec_server(tiny_loaded: LoadedModel) -> Iterator[RunningServer]:
    """The same model with n-gram speculation, so responses carry `usage.speculation`."""
    with serving(tiny_loaded, NgramProposer(block_size=4)) as running:
        yield running


@pytest.fixture
def hook(server: RunningServer) -> Iterator[FinishHookSpy]:
    server.hook.calls.clear()
    yield server.hook
    server.hook.fail = False


@pytest.fixture
def slow_decode(tiny_loaded: LoadedModel) -> Iterator[None]:
    """Every forward pass of the served model takes 10 ms longer, so a full-length request lasts
    seconds and a client can walk away from it mid-generation on any machine."""
    handle = tiny_loaded.model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))
    yield
    handle.remove()


def metric(server: RunningServer, name: str, **labels: str) -> float:
    """One sample's value from `/metrics`, 0 when the labelled series does not exist yet."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0

"""A live drafter swap end to end: real MLflow (SQLite, local artifacts), the server as `specloop serve
--registry` wires it behind a real uvicorn, the real tansu broker and sink, streaming clients running
while the `champion` alias moves from v1 to v2.

Every request must complete (no error, no truncation), every output must be token-identical to plain
greedy decoding, and each trace must name the drafter that drafted it: v1 for requests started
before the alias moved, v2 for those started after the engine answered the reload with a swap.
"""

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.drafter_artifact import Lineage, save_drafter
from specloop.storage.broker import EmbeddedBroker
from specloop.storage.registry import CHAMPION, DrafterRegistry
from tests.integration.conftest import ACME_KEY, registry_wiring, running_sink, serving
from tests.integration.test_capture_pipeline import _rows

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MAX_TOKENS = 24
TEXTS = ["one two three one two three one", "def add(a, b): return a + b", "the quick brown fox", "a b a b a b"]


def expected_tokens(loaded: LoadedModel, text: str) -> list[int]:
    """Plain greedy decoding of the chat prompt for `text`, no drafter: what every response must equal."""
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=1, max_len=256), tok.eos_token_ids)
    return engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[
        0].output_ids


class Clients:
    """Threads that stream chat completions back to back and record each one's id, start and end."""

    def __init__(self, url: str, model: str, count: int) -> None:
        self.url, self.model = url, model
        self.done: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> "Clients":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            text = TEXTS[(i + n) % len(TEXTS)]
            n += 1
            try:
                self.done.append(self._stream(text))
            except Exception as e:  # recorded, not raised: the test reports every failure at the end
                self.failures.append(repr(e))

    def _stream(self, text: str) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "user": "swap-user"}
        started = time.monotonic()
        ids, finish = set(), None
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {ACME_KEY}"}) as r:
            if r.status_code != 200:
                raise AssertionError(f"status {r.status_code}: {r.read()!r}")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            ids.add(chunk["id"])
            finish = chunk["choices"][0]["finish_reason"] or finish
        assert len(ids) == 1 and finish == "length", (ids, finish)
        return {"id": ids.pop(), "text": text, "started": started, "ended": time.monotonic()}


@pytest.fixture
def registry(tmp_path: Path) -> DrafterRegistry:
    return DrafterRegistry(f"sqlite:///{tmp_path / 'registry' / 'mlflow.db'}", tmp_path / "registry" / "artifacts")


def drafter_for(loaded: LoadedModel, block_size: int, seed: int) -> DFlashDrafter:
    """A random one-layer drafter tapping both layers of the tiny 2-layer model."""
    c = loaded.model.config
    torch.manual_seed(seed)
    config = DFlashConfig(num_layers=1, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          vocab_size=c.vocab_size, max_position=c.max_position, tap_layers=(0, 1),
                          target_num_layers=c.num_layers, block_size=block_size, rope_theta=c.rope_theta)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    return drafter.eval()


def _versions(registry: DrafterRegistry, loaded: LoadedModel, tmp_path: Path) -> tuple[str, str]:
    fp = loaded.fingerprint
    v1 = registry.register(save_drafter(tmp_path / "d1", drafter_for(loaded, 4, seed=1), fp,
                                        Lineage("sha256:v1", 1, 1)), fp)
    v2 = registry.register(save_drafter(tmp_path / "d2", drafter_for(loaded, 6, seed=2), fp,
                                        Lineage("sha256:v2", 1, 2)), fp)
    registry.set_alias(fp, CHAMPION, v1.version)
    return v1.version, v2.version


def _serving_version(url: str, timeout_s: float = 60) -> Iterator[str | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        yield httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"]
        time.sleep(0.1)


def test_moving_the_alias_swaps_the_drafter_under_load(broker: EmbeddedBroker, tiny_loaded: LoadedModel,
                                                       registry: DrafterRegistry, tmp_path: Path) -> None:
    v1, v2 = _versions(registry, tiny_loaded, tmp_path)
    expected = {text: expected_tokens(tiny_loaded, text) for text in TEXTS}
    wiring = registry_wiring(broker, tmp_path, registry.tracking_uri, poll_s=60)
    consent, resolved, sink, settings, admin = (wiring.consent, wiring.resolved, wiring.sink, wiring.settings,
                                                wiring.admin)
    with running_sink(sink), serving(tiny_loaded, settings, consent) as (url, _):
        assert next(v for v in _serving_version(url) if v is not None) == f"v{v1}"  # the first look, at start
        r = httpx.post(f"{url}/admin/consents", json={"tenant": "acme", "user": "swap-user"}, headers=admin)
        assert r.status_code == 201, r.text
        with Clients(url, tiny_loaded.name, count=3) as clients:
            time.sleep(1.5)
            moved_at = time.monotonic()
            registry.set_alias(tiny_loaded.fingerprint, CHAMPION, v2)
            reload = httpx.post(f"{url}/admin/drafter/reload", headers=admin, timeout=60)
            swapped_at = time.monotonic()
            time.sleep(1.5)
        assert reload.status_code == 200 and reload.json()["result"] == "swapped", reload.text
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["drafter_version"] == f"v{v2}"
        metrics = httpx.get(f"{url}/metrics").text
        deadline = time.monotonic() + 30
        while len(rows := _rows(resolved.traces_root)) < len(clients.done) and time.monotonic() < deadline:
            time.sleep(0.3)

    assert clients.failures == []
    # A request that started before the move may reach the engine after the swap (the drafter is chosen at
    # admission), so "before" is what had ended by then: v1 served it for certain.
    before = [c for c in clients.done if c["ended"] < moved_at]
    after = [c for c in clients.done if c["started"] > swapped_at]
    assert len(before) >= 3 and len(after) >= 3, (len(before), len(after))
    by_id = {row["trace_id"]: row for row in rows}
    assert len(by_id) == len(clients.done)
    for c in clients.done:
        row = by_id[c["id"]]
        assert row["response_token_ids"] == expected[c["text"]], c
    assert {by_id[c["id"]]["drafter_version"] for c in before} == {f"v{v1}"}
    assert {by_id[c["id"]]["drafter_version"] for c in after} == {f"v{v2}"}
    assert 'specloop_drafter_swaps_total{reason="",result="ok"} 2.0' in metrics
    assert f'specloop_spec_decode_num_drafts_total{{drafter_version="v{v2}"}}' in metrics

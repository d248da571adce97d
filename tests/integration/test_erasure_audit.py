"""The erasure audit, on the real stack: the tiny 6-layer model served with capture through the real
tansu broker and sink, consent through the admin API, real MLflow (SQLite) and the retraining daemon.

One subject's requests carry a canary string. Their traces end up in a compacted Parquet file, in
live sink files, in a finished run's training set (the run promotes a drafter), and one more is in
flight (produced while the sink is down) when the subject revokes consent with erasure. Afterwards a
search of every file under the test's directory (raw bytes; and in Parquet, every text value and
every token-id list, since Parquet compresses) finds the canary 0 times where it found it in each
of those places before; the in-flight trace never lands. As deployed, the engine's eraser cannot
reach the daemon's work directory: the daemon's follow-up scrubs the run's dataset, reports the run
and drafter version trained on the subject in the audit log, and flags that version.

Not covered here: Kafka's own copy (the embedded broker keeps topics in memory, outside the data
directory; docs/data-governance.md says how long a real cluster keeps them).
"""

import json
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer

from specloop.daemon.retrain.policy import parse_policy
from specloop.daemon.retrain.run_log import RunOutcome
from specloop.daemon.retrain.service import RetrainDaemon
from specloop.daemon.retrain.settings import DaemonSettings
from specloop.engine.loaders.load import LoadedModel
from specloop.storage.broker import EmbeddedBroker
from specloop.storage.compaction import compact
from specloop.storage.registry import CHAMPION, DrafterRegistry, Tag
from tests.integration.conftest import ACME_KEY, registry_wiring, running_sink, serving
from tests.integration.test_capture_pipeline import _rows
from tests.integration.test_retrain_cycle import POLICY, WORDS, useless_drafter

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

CANARY = "qzxv-canary-7731-wbfj"


def _chat(url: str, model: str, text: str, user: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "user": user}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {ACME_KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _wait_for_rows(root: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_rows(root)) < count:
        assert time.monotonic() < deadline, f"{count} traces did not reach Parquet"
        time.sleep(0.3)


def _on_topic(bootstrap: str, topic: str, until: str) -> set[str]:
    """Trace ids on the topic, read from the start until `until` is among them (30 s at most)."""
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=1_000)
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    try:
        while until not in seen and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                seen.update(json.loads(r.value)["trace_id"] for r in records)
    finally:
        consumer.close()
    return seen


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def canary_hits(directory: Path, text: str, ids: list[int]) -> list[str]:
    """Every file under `directory` holding `text` in its bytes or, for Parquet, in a text value or
    `ids` inside a token-id list."""
    hits = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        if text.encode() in path.read_bytes():
            hits.append(str(path.relative_to(directory)))
        elif path.suffix == ".parquet" and _parquet_holds(path, text, ids):
            hits.append(str(path.relative_to(directory)))
    return hits


def _parquet_holds(path: Path, text: str, ids: list[int]) -> bool:
    table = pq.read_table(path, partitioning=None)
    for name in table.column_names:
        values = table[name].to_pylist()
        if any(isinstance(v, str) and text in v for v in values):
            return True
        if any(isinstance(v, list) and _contains(v, ids) for v in values):
            return True
    return False


def test_erasure_reaches_every_copy_and_names_the_drafters_trained_on_the_subject(
        broker: EmbeddedBroker, deep_loaded: LoadedModel, tmp_path: Path) -> None:
    fp, model = deep_loaded.fingerprint, deep_loaded.name
    registry = DrafterRegistry(f"sqlite:///{tmp_path / 'registry' / 'mlflow.db'}", tmp_path / "registry" / "art")
    v1 = registry.register(useless_drafter(deep_loaded, tmp_path / "v1"), fp)
    registry.set_alias(fp, CHAMPION, v1.version)
    wiring = registry_wiring(broker, tmp_path, registry.tracking_uri, poll_s=0.5)
    root = wiring.resolved.traces_root
    canary_ids = deep_loaded.tokenizer.encode(f" {CANARY} ")[1:-1]  # its inside, whatever precedes it
    with serving(deep_loaded, wiring.settings, wiring.consent) as (url, _):
        for user in ("u1", "canary-user"):
            assert httpx.post(f"{url}/admin/consents", json={"tenant": "acme", "user": user},
                              headers=wiring.admin).status_code == 201
        with running_sink(wiring.sink):
            # Phase 1, compacted later; phase 2, left in live sink files.
            prompts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(i % 5 + 3)) + f" {i}" for i in range(40)]
            for i, text in enumerate(prompts[:24]):  # in three batches: files to merge in each partition
                _chat(url, model, text, "u1")
                if i % 4 == 0:
                    _chat(url, model, f"note {i}: {CANARY} {text}", "canary-user")
                if i % 8 == 7:
                    _wait_for_rows(root, (i + 1) * 5 // 4)
            assert compact(root).merged_files, "nothing was compacted"
            for i, text in enumerate(prompts[24:]):
                _chat(url, model, text, "u1")
                if i % 4 == 0:
                    _chat(url, model, f"note {i}: {CANARY} {text}", "canary-user")
            _wait_for_rows(root, 50)

            assert not wiring.resolved.work_dir.exists()  # the engine's idea of it: not on its machine
            daemon_settings = DaemonSettings(
                policy=tmp_path / "unused.yaml", registry=registry.tracking_uri, traces_root=root,
                consent_db=wiring.resolved.registry_path, state_db=f"sqlite:///{tmp_path / 'state.db'}",
                work_dir=tmp_path / "daemon-volume" / "runs", engines=[url],
                audit_log=wiring.resolved.audit_log_path)
            daemon = RetrainDaemon(daemon_settings, parse_policy(POLICY), deep_loaded, registry)
            daemon.tick()
            run = daemon.loop.runs.runs()[-1]
            assert run.outcome is RunOutcome.PROMOTED, run.detail
        # The sink is down: this trace is produced and waits in Kafka while the erasure runs.
        in_flight = _chat(url, model, f"last one {CANARY}", "canary-user")
        assert in_flight in _on_topic(wiring.sink.bootstrap_servers, wiring.sink.topic, in_flight)

        before = canary_hits(tmp_path, CANARY, canary_ids)
        assert any("compacted-" in h for h in before), before
        assert any("+" in h and h.startswith("data/traces") for h in before), before
        assert any(h.endswith(f"{run.run_id}/dataset/train.parquet") for h in before), before

        r = httpx.post(f"{url}/admin/consents/revoke", json={"tenant": "acme", "user": "canary-user", "erase": True},
                       headers=wiring.admin, timeout=60)
        assert r.status_code == 200, r.text
        report = r.json()["erasure"]
        with running_sink(wiring.sink):
            marker = _chat(url, model, "after the erasure", "u1")
            deadline = time.monotonic() + 60
            while not _rows(root, "trace_id = $id", {"id": marker}):
                assert time.monotonic() < deadline, "the sink did not catch up"
                time.sleep(0.3)
        left = canary_hits(tmp_path, CANARY, canary_ids)  # only the daemon's copies, out of the eraser's reach
        assert f"daemon-volume/runs/{run.run_id}/dataset/train.parquet" in left, left
        assert all(h.startswith(f"daemon-volume/runs/{run.run_id}/dataset/") for h in left), left
        assert daemon.erasures() == ["v2"]  # its next watch

    assert _rows(root, "trace_id = $id", {"id": in_flight}) == []
    assert canary_hits(tmp_path, CANARY, canary_ids) == []
    assert report["status"] == "ok" and report["erasure"]["work_dir_reached"] is False
    audit = [json.loads(line) for line in wiring.resolved.audit_log_path.read_text().splitlines()]
    [lineage] = [e for e in audit if e["event"] == "erasure_lineage"]
    assert lineage["erasure_id"] == report["erasure"]["erasure_id"]
    assert lineage["drafter_versions"] == [f"{fp} v2"] and lineage["trained_on"] == [f"{run.run_id}: {fp} v2"]
    assert registry.version(fp, "2").tags[Tag.TRAINED_ON_ERASED] == "1"
    assert not list(tmp_path.rglob(".*.tmp"))

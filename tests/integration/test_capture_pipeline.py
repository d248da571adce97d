"""Capture end to end: HTTP request → consent decision → Kafka (real tansu) → sink → Parquet → erasure.

The server is wired exactly as `specloop serve --kafka-bootstrap` wires it (`specloop.engine.server.cli.serving_app`).
"Never reaches Kafka" is checked on the topic itself, by consuming every partition from the start.
"""

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import httpx
import pytest
from kafka import KafkaConsumer

from specloop.storage.layout import live_files
from tests.integration.conftest import ACME_KEY, INITECH_KEY, CaptureStack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EMAIL_PROMPT = "write to jane.doe@example.com about the invoice"


def _rows(root: Path, where: str = "TRUE", params: dict | None = None) -> list[dict]:
    files = [str(p) for p in live_files(root)]
    if not files:
        return []
    relation = duckdb.execute(f"SELECT *, filename FROM read_parquet($files, filename = true) WHERE {where}",
                              {"files": files, **(params or {})})
    names = [d[0] for d in relation.description]
    return [dict(zip(names, row)) for row in relation.fetchall()]


def _wait_for_trace(root: Path, trace_id: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = _rows(root, "trace_id = $id", {"id": trace_id})
        if rows:
            return rows[0]
        time.sleep(0.2)
    raise AssertionError(f"trace {trace_id} never reached Parquet under {root}")


def _topic_trace_ids(stack: CaptureStack, until: str, timeout_s: float = 30.0) -> set[str]:
    """Every trace id on the topic, reading until `until` has been seen and one more second has passed."""
    consumer = KafkaConsumer(stack.topic, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=1_000)
    seen: set[str] = set()
    deadline, grace = time.monotonic() + timeout_s, None
    try:
        while grace is None or time.monotonic() < grace:
            assert time.monotonic() < deadline, f"{until} never reached the topic"
            for record in consumer.poll(timeout_ms=200).values():
                seen.update(json.loads(r.value)["trace_id"] for r in record)
            if grace is None and until in seen:
                grace = time.monotonic() + 1.0  # other partitions may still be delivering earlier traces
    finally:
        consumer.close()
    return seen


def _grant(stack: CaptureStack, user: str, **extra: object) -> dict:
    r = stack.admin("/consents", {"tenant": "acme", "user": user, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_consented_request_becomes_a_parquet_row(stack: CaptureStack) -> None:
    grant = _grant(stack, "alice")
    # Repetitive text gives the n-gram drafter something to draft from, so the spec stats are not all zero.
    r = stack.chat("one two three one two three one two three one two", user="alice", max_tokens=24)
    assert r.status_code == 200, r.text
    body = r.json()
    row = _wait_for_trace(stack.consent.traces_root, body["id"])
    tok = stack.loaded.tokenizer
    messages = [{"role": "user", "content": "one two three one two three one two three one two"}]
    assert row["prompt_token_ids"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert len(row["response_token_ids"]) == body["usage"]["completion_tokens"] == 24
    assert tok.decode(row["response_token_ids"]) == body["choices"][0]["message"]["content"] == row["response_text"]
    assert f"base_model={stack.loaded.fingerprint}/dt=" in row["filename"] and row["base_model"] == body[
        "system_fingerprint"]
    spec = body["usage"]["speculation"] or {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    assert row["spec"] == {k: spec[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    assert row["spec"]["drafts"] > 0
    assert (row["tenant"], row["consent_id"], row["consent_policy_version"]) == ("acme", grant["consent_id"], "2026-01")
    assert row["subject"] == stack.subject("acme", "alice") != "alice"
    assert row["sampling"]["max_tokens"] == 24 and row["sampling"]["temperature"] == 0.0


def test_the_subject_header_wins_over_the_user_field(stack: CaptureStack) -> None:
    _grant(stack, "hank")
    r = stack.chat("hello there", user="nobody-consented", headers={"X-Specloop-User": "hank"})
    row = _wait_for_trace(stack.consent.traces_root, r.json()["id"])
    assert row["subject"] == stack.subject("acme", "hank")


def test_unconsented_revoked_expired_and_pii_requests_never_reach_kafka(stack: CaptureStack) -> None:
    _grant(stack, "carol")
    assert stack.admin("/consents/revoke", {"tenant": "acme", "user": "carol"}).status_code == 200
    _grant(stack, "dave", expires_at=(datetime.now(UTC) + timedelta(seconds=1)).isoformat())
    _grant(stack, "erin")
    time.sleep(1.2)  # dave's consent expires
    before = {reason: stack.metric(f'specloop_capture_decisions_total{{reason="{reason}"}}')
              for reason in ("no_consent", "consent_revoked", "consent_expired", "pii_dropped", "tenant_disallows",
                             "no_user")}
    tok = stack.loaded.tokenizer
    token_prompt = {"model": stack.model, "prompt": tok.encode(EMAIL_PROMPT), "max_tokens": 4, "user": "erin"}
    gated = [
        stack.chat("hello", user="bob"),  # never consented
        stack.chat("hello", user="carol"),  # revoked
        stack.chat("hello", user="dave"),  # expired
        stack.chat(EMAIL_PROMPT, user="erin"),  # PII in the prompt text
        httpx.post(f"{stack.base_url}/v1/completions", json=token_prompt, timeout=30,
                   headers={"Authorization": f"Bearer {ACME_KEY}"}),  # PII hidden in token ids
        stack.chat("hello", key=INITECH_KEY, user="erin"),  # tenant disallows capture
        stack.chat("hello", key=None, user="erin"),  # anonymous
        stack.chat("hello"),  # no user at all
    ]
    assert [r.status_code for r in gated] == [200] * len(gated), [r.text for r in gated]
    marker = stack.chat("a clean request from a consenting user", user="erin")
    on_topic = _topic_trace_ids(stack, marker.json()["id"])
    assert not on_topic & {r.json()["id"] for r in gated}
    after = {reason: stack.metric(f'specloop_capture_decisions_total{{reason="{reason}"}}') for reason in before}
    assert {reason: after[reason] - before[reason] for reason in before} == {
        "no_consent": 1, "consent_revoked": 1, "consent_expired": 1, "pii_dropped": 2, "tenant_disallows": 2,
        "no_user": 1}


def test_revoke_with_erase_removes_every_row_and_is_audited(stack: CaptureStack) -> None:
    _grant(stack, "frank")
    ids = [stack.chat(f"frank's request {i}", user="frank").json()["id"] for i in range(2)]
    for trace_id in ids:
        _wait_for_trace(stack.consent.traces_root, trace_id)
    subject = stack.subject("acme", "frank")
    others = len(_rows(stack.consent.traces_root, "subject != $s", {"s": subject}))
    r = stack.admin("/consents/revoke", {"tenant": "acme", "user": "frank", "erase": True})
    assert r.status_code == 200, r.text
    assert r.json()["erasure"]["status"] == "ok"
    assert _rows(stack.consent.traces_root, "subject = $s", {"s": subject}) == []
    assert len(_rows(stack.consent.traces_root, "subject != $s", {"s": subject})) == others
    entries = [json.loads(line) for line in stack.consent.audit_log_path.read_text().splitlines()]
    erasures = [e for e in entries if e["event"] == "revoke_and_erase" and e.get("subject") == subject]
    assert len(erasures) == 1 and erasures[0]["status"] == "ok", erasures

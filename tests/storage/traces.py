"""Builders of valid v1 traces for the storage tests (deterministic token ids per seed)."""

import random
import uuid
from datetime import UTC, datetime, timedelta

from specloop.storage.schema import Trace, TraceSampling, TraceSpecStats

SUBJECT_A = "a" * 64
SUBJECT_B = "b" * 64
T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def make_trace(
    trace_id: str | None = None,
    *,
    created_at: datetime = T0,
    tenant: str = "acme",
    subject: str = SUBJECT_A,
    consent_id: str = "consent-a",
    base_model: str = "fp-test",
    prompt_len: int = 16,
    response_len: int = 16,
    seed: int = 0,
) -> Trace:
    rng = random.Random(seed)
    return Trace(
        trace_id=trace_id or uuid.uuid4().hex,
        created_at=created_at,
        finished_at=created_at + timedelta(milliseconds=250),
        tenant=tenant,
        subject=subject,
        consent_id=consent_id,
        consent_policy_version="2025-01",
        base_model=base_model,
        drafter_version="3",
        endpoint="/v1/chat/completions",
        sampling=TraceSampling(temperature=0.0, top_p=1.0, top_k=0, max_tokens=64, seed=7),
        prompt_token_ids=[rng.randrange(49152) for _ in range(prompt_len)],
        response_token_ids=[rng.randrange(49152) for _ in range(response_len)],
        prompt_text="hello",
        response_text="world",
        spec=TraceSpecStats(drafts=4, draft_tokens=16, accepted_tokens=9),
        finish_reason="stop",
    )

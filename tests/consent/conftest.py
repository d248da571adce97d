"""Fixtures for the consent tests: a registry file, a resolved config and a tenant directory."""

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from specloop.consent.pseudonym import Pseudonymizer
from specloop.consent.registry import ConsentRegistry
from specloop.consent.settings import ConsentConfig
from specloop.consent.tenants import TenantDirectory, TenantPolicy

HMAC_KEY = b"k3y-for-tests-only-5d1f0c9a7b2e4f6a8c0d"
ADMIN_TOKEN = "adm1n-tok3n-for-tests-9f8e7d6c5b4a3210"
ACME_KEY = "acme-api-key-0123456789abcdef"


@pytest.fixture
def config(tmp_path: Path) -> ConsentConfig:
    return ConsentConfig(
        hmac_key=HMAC_KEY,
        admin_token=ADMIN_TOKEN,
        registry_path=tmp_path / "consent.db",
        audit_log_path=tmp_path / "audit.jsonl",
        traces_root=tmp_path / "traces",
        work_dir=tmp_path / "daemon" / "runs",
        tenants_path=None,
        pii_mode="drop",
    )


@pytest.fixture
def registry(config: ConsentConfig) -> ConsentRegistry:
    reg = ConsentRegistry(config.registry_path)
    yield reg
    reg.close()


@pytest.fixture
def pseudonymizer() -> Pseudonymizer:
    return Pseudonymizer(HMAC_KEY)


@pytest.fixture
def tenants() -> TenantDirectory:
    return TenantDirectory(
        [
            TenantPolicy(name="acme", api_keys=(ACME_KEY,), capture_allowed=True,
                         policy_version="2025-06"),
            TenantPolicy(name="globex", api_keys=("globex-api-key-0123456789",),
                         capture_allowed=True, policy_version="2025-06", pii_mode="strip"),
            TenantPolicy(name="initech", api_keys=("initech-api-key-01234567",)),
        ],
        allow_anonymous=False,
    )


@pytest.fixture
def write_traces(config: ConsentConfig) -> Callable[[list[tuple[str, str]], int], Path]:
    """Writes one real sink-named Parquet file of traces for (tenant, subject) pairs via storage."""
    schema = pytest.importorskip("specloop.storage.schema")
    layout = pytest.importorskip("specloop.storage.layout")

    def write(owners: list[tuple[str, str]], first_offset: int) -> Path:
        at = datetime(2025, 6, 1, 12, tzinfo=UTC)
        traces = [
            schema.Trace(
                trace_id=f"t-{first_offset + i}", created_at=at, finished_at=at, tenant=tenant,
                subject=subject, consent_id="c-1", consent_policy_version="2025-06",
                base_model="fp-test", drafter_version=None, endpoint="/v1/chat/completions",
                sampling=schema.TraceSampling(temperature=0.0, top_p=1.0, top_k=0, max_tokens=8),
                prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], prompt_text="hi",
                response_text="hello",
                spec=schema.TraceSpecStats(drafts=1, draft_tokens=4, accepted_tokens=2),
                finish_reason="stop",
            )
            for i, (tenant, subject) in enumerate(owners)
        ]
        directory = layout.hive_dir(config.traces_root, "fp-test", "2025-06-01")
        path = directory / layout.sink_file_name("traces", 0, first_offset)
        layout.write_parquet_atomic(path, schema.to_arrow(traces))
        return path

    return write


@pytest.fixture
def subject_rows(config: ConsentConfig) -> Callable[[str, str], int]:
    """Counts the rows of (tenant, subject) that DuckDB finds under the trace root."""
    import duckdb

    def count(tenant: str, subject: str) -> int:
        files = [str(p) for p in config.traces_root.glob("base_model=*/dt=*/*.parquet")]
        return duckdb.execute(
            "SELECT count(*) FROM read_parquet($files) WHERE tenant = $t AND subject = $s",
            {"files": files, "t": tenant, "s": subject},
        ).fetchall()[0][0]

    return count


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every consent test is a unit test of seconds at most; 30 s means something hangs."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(30))

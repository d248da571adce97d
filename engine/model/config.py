"""Model architecture config: one frozen dataclass for the Llama family (Llama, SmolLM2, Qwen2, Qwen3).

It is built once at the edge (from a Hugging Face `config.json` dict or from GGUF metadata) and
validated there; the model code trusts it. It is not the serving config (see `engine/server/settings.py`).
"""

from dataclasses import dataclass, field
from typing import Any, Literal

Arch = Literal["llama", "qwen2", "qwen3"]

_HF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear`, `dynamic` (NTK, applied statically), `llama3` or `yarn`."""

    kind: Literal["linear", "dynamic", "llama3", "yarn"]
    factor: float
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_position is None:
            raise ValueError(f"rope_scaling.original_max_position_embeddings is required for {self.kind}")

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None) -> "RopeScaling | None":
        if not d:
            return None
        kind = d.get("rope_type", d.get("type"))
        if kind in (None, "default"):
            return None
        if kind not in ("linear", "dynamic", "llama3", "yarn"):
            raise ValueError(f"rope_scaling.rope_type {kind!r} is not supported")
        return cls(
            kind=kind,
            factor=float(d["factor"]),
            original_max_position=d.get("original_max_position_embeddings"),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            beta_fast=float(d.get("beta_fast", 32.0)),
            beta_slow=float(d.get("beta_slow", 1.0)),
        )


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; unknown architectures are refused."""
        archs = d.get("architectures") or []
        arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
        if arch is None and d.get("model_type") in ("llama", "qwen2", "qwen3"):
            arch = d["model_type"]
        if arch is None:
            raise ValueError(f"config.json: architectures {archs} / model_type {d.get('model_type')!r} not supported")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        # transformers 5 moved rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            max_position=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=RopeScaling.from_hf(rope),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

"""Rotary position embedding tables: default, linear, llama3 and yarn frequency scaling.

Tables follow the Hugging Face "rotate half" convention, because every loader hands the model
weights in Hugging Face layout (the GGUF loader undoes llama.cpp's interleaving permutation).
Dynamic NTK scaling is refused rather than approximated: it changes frequencies with the length
of each sequence, which a shared table cannot express.
"""

import math

import torch

from specloop.engine.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies `[head_dim // 2]` (fp32) and the attention scale for cos/sin."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return inv.float(), 1.0
    if scaling.kind == "linear":
        return (inv / scaling.factor).float(), 1.0
    if scaling.kind == "llama3":
        return _llama3(inv, scaling).float(), 1.0
    if scaling.kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    raise ValueError(f"rope_scaling kind {scaling.kind!r} is not supported (dynamic NTK varies per length)")


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    assert s.original_max_position is not None
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    assert s.original_max_position is not None

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    mixed = (inv / s.factor) * (1 - extrapolate) + inv * extrapolate
    attention_scale = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return mixed.float(), attention_scale


def rope_tables(config: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each `[length, head_dim]` fp32."""
    inv, scale = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[B, H, n, D]` by per-token tables `[B, 1, n, D]` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin

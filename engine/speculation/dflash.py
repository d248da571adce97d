"""The DFlash drafter: a few decoder layers that draft a whole block in one pass, conditioned on the target.

Context features are the outputs of a few target layers spread over its depth (`tap_layers`),
concatenated and fused by one linear layer plus RMSNorm into `[T, H]`. Every drafter layer projects
those fused features with its own key/value weights (after QK-norm and RoPE at the context
positions) and prepends them to the block's own keys/values; queries come from the block only. The
context is never itself run through the layers, so its per-layer K/V depend on the fused features
alone and can be cached once per observed position, like a target KV cache.

A block is `[anchor token, mask × (B−1)]` at positions `p .. p+B−1`: it sees context positions `< p`
and, bidirectionally, its own block. Output position i (1 ≤ i < B) predicts the token at `p + i`
through the target's final LM head. Token embedding and LM head are borrowed from the target
(frozen) and are not parameters of this module; the mask is a learned embedding unless the config
names a mask token of the target vocabulary. An optional `vocab_ids` buffer trims the output
vocabulary to the tokens seen in training.

This file holds the module and its maths only: serving-time state (per-slot context cache) is in
`engine/speculation/dflash_proposer.py`, the training objective in `daemon/training/objective.py`,
files in `engine/speculation/drafter_artifact.py`.
"""

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specloop.engine.model.attention import attend
from specloop.engine.model.config import ModelConfig, RopeScaling
from specloop.engine.model.rope import apply_rope, rope_tables
from specloop.engine.model.transformer import MLP, RMSNorm


def spread_tap_layers(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """`num_taps` target layers spread evenly from layer 1 to L−3 (the reference's choice); L//2 for one."""
    if num_taps <= 0 or num_target_layers < 4:
        raise ValueError(f"need num_taps > 0 and a target with >= 4 layers, got {num_taps}, {num_target_layers}")
    if num_taps == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    return tuple(sorted({round(first + i * (last - first) / (num_taps - 1)) for i in range(num_taps)}))


_INT_FIELDS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
               "vocab_size", "max_position", "target_num_layers", "block_size")
_OPTIONAL_INT_FIELDS = ("mask_token_id", "output_vocab_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class DFlashConfig:
    """Drafter architecture. Widths match the target (the drafter reads target embeddings and writes
    into the target's LM head); depth, block size and taps are the drafter's own."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's full vocabulary
    max_position: int
    tap_layers: tuple[int, ...]
    target_num_layers: int
    block_size: int = 16
    mask_token_id: int | None = None  # None: a learned mask embedding
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    output_vocab_size: int | None = None  # set when the output vocabulary is trimmed

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {self.num_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor plus at least one draft), got {self.block_size}")
        if not self.tap_layers or list(self.tap_layers) != sorted(set(self.tap_layers)):
            raise ValueError(f"tap_layers must be non-empty, ascending and unique, got {self.tap_layers}")
        if self.tap_layers[0] < 0 or self.tap_layers[-1] >= self.target_num_layers:
            raise ValueError(f"tap_layers {self.tap_layers} outside the target's {self.target_num_layers} layers")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocabulary of {self.vocab_size}")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ValueError(f"output_vocab_size must be in 1..{self.vocab_size}, got {self.output_vocab_size}")

    def _check_types(self) -> None:
        """A config read from a registry is untrusted: every size an integer, every float finite."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _INT_FIELDS or (f.name in _OPTIONAL_INT_FIELDS and value is not None):
                if not _is_int(value):
                    raise ValueError(f"{f.name} must be an integer, got {value!r}")
            elif f.name in ("rms_norm_eps", "rope_theta"):
                if not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                    raise ValueError(f"{f.name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tap_layers, tuple) or not all(_is_int(t) for t in self.tap_layers):
            raise ValueError(f"tap_layers must be integers, got {self.tap_layers!r}")

    @classmethod
    def for_target(cls, target: ModelConfig, num_layers: int = 1, num_taps: int = 5, block_size: int = 16,
                   mask_token_id: int | None = None) -> "DFlashConfig":
        return cls(
            num_layers=num_layers, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            vocab_size=target.vocab_size, max_position=target.max_position,
            tap_layers=spread_tap_layers(target.num_layers, num_taps), target_num_layers=target.num_layers,
            block_size=block_size, mask_token_id=mask_token_id, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a drafter that does not fit this target (the fingerprint check is the artifact's), before
        anything is allocated: every dimension that sizes a tensor is the target's own (widths, heads,
        vocabulary) or at most the target's (layers, positions), so no config can ask for more memory
        than a drafter as deep as the target."""
        for name in ("hidden_size", "vocab_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) != getattr(target, name):
                raise ValueError(f"drafter {name} {getattr(self, name)} != target {name} {getattr(target, name)}")
        if self.target_num_layers != target.num_layers:
            raise ValueError(f"drafter was built for a {self.target_num_layers}-layer target, got {target.num_layers}")
        if self.num_layers > target.num_layers:
            raise ValueError(f"drafter num_layers {self.num_layers} > the target's {target.num_layers}")
        if not 0 < self.max_position <= target.max_position:
            raise ValueError(f"drafter max_position {self.max_position} outside 1..{target.max_position}, the target's")

    @property
    def model_config(self) -> ModelConfig:
        """The drafter as a `ModelConfig`, for `KVCache` and RoPE tables."""
        return ModelConfig(
            arch="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, max_position=self.max_position,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            qk_norm=True,
        )

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tap_layers"] = list(self.tap_layers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DFlashConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"drafter config: unknown fields {unknown}")
        d = dict(d)
        d["tap_layers"] = tuple(d["tap_layers"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


class DrafterLayer(nn.Module):
    """One decoder layer whose attention also reads injected context keys/values."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.kv = nn.Linear(c.hidden_size, 2 * c.num_kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.model_config)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (QK-normed, rotated) and values `[B, Hkv, n, D]` for inputs `[B, n, H]`."""
        B, n, _ = x.shape
        k, v = self.kv(x).view(B, n, 2, self.c.num_kv_heads, self.c.head_dim).unbind(dim=2)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        return k, v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: "torch.Tensor | SeparateBlocks") -> torch.Tensor:
        """x `[B, n, H]` block states; ctx_k/ctx_v `[B, Hkv, T, D]`; mask `[B, 1, n, T + n]` bool (True =
        see), or `SeparateBlocks` when the n queries are independent blocks (training)."""
        B, n, _ = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(B, n, self.c.num_heads, self.c.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)  # [B, Hq, n, D]
        k, v = self.project_kv(h, cos, sin)  # [B, Hkv, n, D]
        if isinstance(mask, SeparateBlocks):
            out = mask.attend(q, ctx_k, ctx_v, k, v)
        else:
            keys = torch.cat([ctx_k, k], dim=2)  # [B, Hkv, T + n, D]
            values = torch.cat([ctx_v, v], dim=2)
            out = attend(q, keys, values, mask)
        x = x + self.o(out.transpose(1, 2).reshape(B, n, -1))
        return x + self.mlp(self.post_norm(x))


class DFlashDrafter(nn.Module):
    """Parameters: fusion (`fc`, `hidden_norm`), layers, final norm, learned mask embedding."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.tap_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.mask_token_id is None else None
        vocab = torch.arange(c.output_vocab_size or c.vocab_size)
        self.register_buffer("vocab_ids", vocab, persistent=c.output_vocab_size is not None)  # [V'] long
        cos, sin = rope_tables(c.model_config, c.max_position, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)  # [T, D] fp32
        self.register_buffer("rope_sin", sin, persistent=False)  # [T, D] fp32

    @property
    def trimmed(self) -> bool:
        return self.config.output_vocab_size is not None

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, 1, n, D]` for positions `[B, n]`."""
        return (self.rope_cos[positions].unsqueeze(1).to(dtype), self.rope_sin[positions].unsqueeze(1).to(dtype))

    def fuse(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Target layer outputs, each `[B, n, H]`, in `tap_layers` order → context features `[B, n, H]`."""
        assert len(taps) == len(self.config.tap_layers), f"got {len(taps)} taps for {self.config.tap_layers}"
        return self.fuse_rows(torch.cat(taps, dim=-1))

    def fuse_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """`fuse` of the taps already side by side, `[B, n, T·H]` → `[B, n, H]`."""
        return self.hidden_norm(self.fc(rows.to(self.fc.weight.dtype)))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys/values `[B, Hkv, n, D]` for fused features `[B, n, H]` at positions `[B, n]`."""
        cos, sin = self.rope(positions, fused.dtype)
        return [layer.project_kv(fused, cos, sin) for layer in self.layers]

    def embed_block(self, anchors: torch.Tensor, block_size: int, embed: nn.Module) -> torch.Tensor:
        """`[anchor, mask × (block_size−1)]` embeddings `[B, N·block_size, H]` for anchor tokens `[B, N]`,
        through the target's embedding (`nn.Embedding` or `Nvfp4Embedding`)."""
        B, N = anchors.shape
        if self.mask_embedding is None:
            ids = torch.full((B, N, block_size), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
            ids[:, :, 0] = anchors
            return embed(ids).view(B, N * block_size, -1).to(self.fc.weight.dtype)
        first = embed(anchors).to(self.mask_embedding.dtype).unsqueeze(2)  # [B, N, 1, H]
        rest = self.mask_embedding.view(1, 1, 1, -1).expand(B, N, block_size - 1, -1)
        return torch.cat([first, rest], dim=2).view(B, N * block_size, -1)

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                   mask: "torch.Tensor | SeparateBlocks") -> torch.Tensor:
        """Block embeddings `[B, n, H]` at positions `[B, n]` → final-normed hidden `[B, n, H]`."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, ctx, strict=True):
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    def head_weight(self, lm_head: nn.Linear) -> torch.Tensor:
        """The rows of the target's LM head this drafter may output `[V', H]` (all rows when untrimmed)."""
        return lm_head.weight[self.vocab_ids] if self.trimmed else lm_head.weight


def context_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """`[B, 1, N·bs, S]`: which of S context positions each query of N blocks per row sees (block j,
    anchored at p, sees positions `< p`; dropped blocks, keep False, see none)."""
    q_block = torch.arange(anchors.shape[1] * block_size, device=anchors.device) // block_size  # [Q]
    anchor_of_q = anchors[:, q_block]  # [B, Q]
    ctx_pos = torch.arange(ctx_len, device=anchors.device)
    sees_ctx = (ctx_pos.view(1, 1, -1) < anchor_of_q.unsqueeze(-1)) & keep[:, q_block].unsqueeze(-1)  # [B, Q, S]
    return sees_ctx.unsqueeze(1)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Training mask `[B, 1, N·bs, S + N·bs]` for N blocks per row over a context of S positions.

    Block j (anchor at position p) sees context positions `< p` and its own block, both ways; other
    blocks are invisible. Dropped blocks (keep False) see only themselves, so no row is empty.
    `SeparateBlocks` computes the same attention without the dense block-by-block part.
    """
    B, N = anchors.shape
    q_block = torch.arange(N * block_size, device=anchors.device) // block_size  # [Q]
    sees_block = (q_block.view(-1, 1) == q_block.view(1, -1)).unsqueeze(0).expand(B, -1, -1)  # [B, Q, Q]
    return torch.cat([context_mask(anchors, keep, ctx_len, block_size)[:, 0], sees_block], dim=-1).unsqueeze(1)


@dataclass(frozen=True)
class SeparateBlocks:
    """N blocks of `block_size` queries per row, each seeing the context where `ctx_mask` `[B, 1, N·bs, T]`
    allows and its own block only: the training layout of `block_mask`, attended without the
    `[N·bs, N·bs]` block-to-block scores that are all masked but the diagonal. With every position of
    4 SmolLM2 answers an anchor of a 4-block, dense attention was 56% of a training step here (SDPA
    1.05 of 1.87 s); this way the step took 1.53 s."""

    ctx_mask: torch.Tensor
    block_size: int

    def attend(self, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q `[B, Hq, n, D]`, ctx_k/ctx_v `[B, Hkv, T, D]`, k/v `[B, Hkv, n, D]` → `[B, Hq, n, D]`."""
        B, Hq, n, D = q.shape
        bs, T = self.block_size, ctx_k.shape[2]
        assert n % bs == 0 and self.ctx_mask.shape[-2:] == (n, T), (q.shape, ctx_k.shape, self.ctx_mask.shape)
        g = Hq // k.shape[1]
        ctx_k, ctx_v, k, v = (t.repeat_interleave(g, dim=1) for t in (ctx_k, ctx_v, k, v))  # Hkv → Hq
        qb = q.view(B, Hq, n // bs, bs, D)
        s_ctx = (q @ ctx_k.transpose(-1, -2)).float().masked_fill(~self.ctx_mask, float("-inf"))  # [B, Hq, n, T]
        s_blk = (qb @ k.view(qb.shape).transpose(-1, -2)).float().view(B, Hq, n, bs)  # own block only
        p = (torch.cat([s_ctx, s_blk], dim=-1) * D**-0.5).softmax(dim=-1).to(v.dtype)
        out_blk = p[..., T:].reshape(B, Hq, n // bs, bs, bs) @ v.view(qb.shape)
        return (p[..., :T] @ ctx_v + out_blk.view(B, Hq, n, D)).to(q.dtype)

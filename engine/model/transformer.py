"""The Llama-family decoder (Llama/SmolLM2, Qwen2 with QKV bias, Qwen3 with QK-norm) with GQA and RoPE.

One `forward` serves every use: prefill, one-token decode, scoring a block of k proposed tokens
(speculative verification), and cache-less full-sequence passes (training, reference checks). It
can return the hidden states of chosen layers, which the DFlash drafter is conditioned on.

This file knows nothing about tokenizers, sampling, scheduling or file formats: weights arrive as a
Hugging Face-named state dict through `load_hf_state_dict`, from whichever loader read them.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specloop.engine.model.attention import attend
from specloop.engine.model.config import ModelConfig
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (it accumulates bf16 in fp32): the reference's upcast-normalise-downcast-scale
        # sequence costs 3 ops, and at 30 layers x 2 norms per token the op overhead adds up.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.qkv = nn.Linear(c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.attention_bias)
        self.o = nn.Linear(c.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: KVCache | None, batch: AttnBatch | None) -> torch.Tensor:
        B, n, _ = x.shape  # [B, n, H]
        c = self.c
        qk, v = self.qkv(x).split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        qk = qk.view(B, n, c.num_heads + c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        # Queries and keys rotate in one call: half the RoPE ops per layer.
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([c.num_heads, c.num_kv_heads], dim=1)  # [B, H, n, D]
        v = v.view(B, n, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, n, D]
        if cache is None:
            out = attend(q, k, v, causal=n > 1)
        else:
            assert batch is not None
            cache.write(layer, batch, k, v)
            keys, values = cache.read(layer, batch)  # [B, Hkv, kv_len, D]
            out = attend(q, keys, values, batch.mask)
        return self.o(out.transpose(1, 2).reshape(B, n, c.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: KVCache | None, batch: AttnBatch | None) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, layer, cache, batch)
        return x + self.mlp(self.post_norm(x))


class Transformer(nn.Module):
    """Decoder stack. `forward` returns final-normed hidden states; `logits` applies the LM head."""

    def __init__(self, config: ModelConfig, rope_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config, rope_len or config.max_position, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)  # [T, D] fp32
        self.register_buffer("rope_sin", sin, persistent=False)  # [T, D] fp32
        self.fused_decoder = None  # set by `specloop.engine.cpu.fused_decode.attach` for small cached passes on the CPU

    # The final norm's weight, not the embedding's, gives device and dtype: an NVFP4 embedding
    # (engine/model/nvfp4_embedding.py) has no dense weight to read.
    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, batch: AttnBatch | None = None,
                taps: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run `tokens` `[B, n]`; return hidden `[B, n, H]` and the outputs of layers in `taps`.

        With a cache, `batch` says where each row's tokens go; without one, rows start at position 0
        and attend causally among themselves. Small cached passes go to the attached C++ decoder when
        there is one (`engine/cpu/fused_decode.py`); the result is the same up to rounding.
        """
        B, n = tokens.shape
        if self.fused_decoder is not None and cache is not None and self.fused_decoder.accepts(B, n, cache):
            return self.fused_decoder.forward(self.embed(tokens), cache, batch, taps)
        positions = batch.positions if batch is not None else torch.arange(n, device=tokens.device).expand(B, n)
        assert positions.shape == (B, n)
        cos = self.rope_cos[positions].unsqueeze(1).to(self.dtype)  # [B, 1, n, D]
        sin = self.rope_sin[positions].unsqueeze(1).to(self.dtype)  # [B, 1, n, D]
        x = self.embed(tokens)
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, cache, batch)
            if i in taps:
                tapped.append(x)
        return self.norm(x), tapped

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[..., V]` for hidden states `[..., H]`."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up; refuses missing or extra names."""
        remaining = dict(sd)

        def take(name: str) -> torch.Tensor:
            if name not in remaining:
                raise ValueError(f"weights: missing tensor {name!r}")
            return remaining.pop(name)

        self.embed.weight.copy_(take("model.embed_tokens.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.attn
            a.qkv.weight.copy_(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]))
            if self.config.attention_bias:
                a.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            a.o.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if self.config.qk_norm:
                a.q_norm.weight.copy_(take(p + "self_attn.q_norm.weight"))
                a.k_norm.weight.copy_(take(p + "self_attn.k_norm.weight"))
            layer.mlp.gate_up.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_norm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.weight.copy_(take(p + "post_attention_layernorm.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        head = remaining.pop("lm_head.weight", None)
        if not self.config.tie_word_embeddings:
            if head is None:
                raise ValueError("weights: missing tensor 'lm_head.weight' for an untied model")
            self.lm_head.weight.copy_(head)
        if remaining:
            raise ValueError(f"weights: unexpected tensors {sorted(remaining)[:5]}")

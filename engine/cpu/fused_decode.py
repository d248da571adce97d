"""The C++ small-batch forward pass (`kernels/cpu_decode.cpp`) attached to a `Transformer` on the CPU.

Decode steps and short verify blocks feed a few rows through the model; there the eager path pays
per-op dispatch around every small matrix. Attached, `Transformer.forward` hands such passes with a
KV cache to one C++ call (`FusedDecoder.accepts`); longer blocks (prefill chunks) stay eager, where
oneDNN's blocked GEMM reuses each weight across rows.

Measured on SmolLM2-135M (2 cores, bf16, 300-token context), one pass plus the LM head, fused vs
eager: 1 sequence 9.5 vs 22.5 ms, 8 sequences 19.5 vs 33.0, 16 sequences 33.1 vs 47.7, 32
sequences 65.8 vs 81.0, 48 sequences 91.3 vs 121.1; one sequence with a 16-token block 33.8 vs
36.2, with 24 tokens 46.1 vs 47.6, with 32 tokens eager won (50.2 vs 60.8).

`FusedDrafter` runs a DFlash drafter's block the same way (`block=True`: the block's rows see each
other both ways and the cached context, and write nothing into the cache), and writes its context
keys/values from fused target features (`context`); what that saves per step is in
`engine/speculation/dflash_proposer.py`.

This file is not the kernels (C++) and not the decision to optimise a model for the CPU
(`engine/cpu/linear.py`); it hands the model's weights to the kernel, which packs its own copy.
"""

from collections.abc import Sequence

import torch

from specloop.engine.model.config import ModelConfig
from specloop.engine.model.gguf_linear import GgufLinear
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.kernels.cpu_decode import load
from specloop.kernels.nvfp4 import NVFP4Weight

# Passes the kernel takes: up to MAX_ROWS rows of any shape, and one-token decode steps of up to
# MAX_DECODE_ROWS sequences. Above that oneDNN's GEMM, which reuses each weight across many rows,
# wins for blocks; decode steps keep winning at 48 sequences (91 vs 121 ms) because eager attention
# over many separate contexts is slow.
# MAX_ROWS covers the server's default verify pass, 8 sequences x block 4. At 16, that pass ran
# eager, whose numerics differ (the kernel keeps activations in fp32 between matrices), so answers
# changed with the load and a drafter met features unlike those it was trained on. On the Zen 3
# (benchmarks/kernel_rows.py), the demo's retrained drafter + n-gram, 40 held-out formal-logic
# prompts at concurrency 8: τ 3.027 and 120-131 tok/s at 16 against τ 3.293 and 144-157 tok/s at
# 32, where every answer equals concurrency 1's (19 of 40 at 16).
MAX_ROWS = 32
MAX_DECODE_ROWS = 64
FP4_CHUNK = 64  # NVFP4 matrices reach the kernel in chunks of 64 inputs (kernels/cpu_decode.cpp)
_MATRICES = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # a layer's, in the kernel's order


def _matrix(module: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What the kernel's `Decoder` takes for one matrix: the dense weight, NVFP4 codes with (block
    scales as bytes, tensor scale), or a `GgufLinear`'s tiles with (rows, ggml type); see
    `kernels/cpu_decode.cpp`."""
    if isinstance(module, GgufLinear):
        return module.tiles, [torch.tensor(module.out_features), torch.tensor(module.ggml_type)]
    q: NVFP4Weight | None = getattr(module, "q", None)
    if q is None:
        return module.weight, [torch.empty(0), torch.empty(0)]
    return q.packed, [q.block_scale.view(torch.uint8), q.tensor_scale]


class FusedDecoder:
    """Holds the kernel's `Decoder` (sharing the model's weight storage) and calls it."""

    def __init__(self, kernel: object, model: torch.nn.Module) -> None:
        c = model.config
        empty = torch.empty(0)
        layers, quantized = [], []
        for layer in model.layers:
            a = layer.attn
            (qkv, qkv4), (o, o4), (gate_up, gate_up4), (down, down4) = (
                _matrix(layer.get_submodule(name)) for name in _MATRICES)
            layers.append([
                layer.input_norm.weight, qkv, a.qkv.bias if a.qkv.bias is not None else empty,
                a.q_norm.weight if a.q_norm is not None else empty, a.k_norm.weight if a.k_norm is not None else empty,
                o, layer.post_norm.weight, gate_up, down,
            ])
            quantized.append(qkv4 + o4 + gate_up4 + down4)
        self.decoder = kernel.Decoder(layers, model.norm.weight, model.rope_cos.float(), model.rope_sin.float(),
                                      c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, quantized)
        self.isa = kernel.isa  # the build it runs on (kernels/cpu_features.py)

    @staticmethod
    def accepts(B: int, n: int, cache: KVCache) -> bool:
        """Whether a pass of B sequences with n new tokens each over `cache` runs here (else eager):
        the kernel reads and writes the fp32 cache the CPU engine keeps (engine/model/attention.py)."""
        return cache.k.dtype == torch.float32 and (B * n <= MAX_ROWS or (n == 1 and B <= MAX_DECODE_ROWS))

    def forward(self, x: torch.Tensor, cache: KVCache, batch: AttnBatch,
                taps: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """x `[B, n, H]` token embeddings → final-normed hidden `[B, n, H]` and tapped layer outputs."""
        B, n, H = x.shape
        assert self.accepts(B, n, cache) and batch.size == B and batch.num_new == n
        hidden, tapped = self.decoder.forward(x.reshape(B * n, H), batch.slots, batch.positions, cache.k, cache.v,
                                              list(taps))
        return hidden.view(B, n, H), [t.view(B, n, H) for t in tapped]


class FusedDrafter:
    """A DFlash drafter's layers and final norm in the kernel's `Decoder`: one call per draft block."""

    def __init__(self, kernel: object, drafter: torch.nn.Module) -> None:
        c = drafter.config
        empty = torch.empty(0)
        layers = [[layer.input_norm.weight, torch.cat([layer.q.weight, layer.kv.weight]), empty, layer.q_norm.weight,
                   layer.k_norm.weight, layer.o.weight, layer.post_norm.weight, layer.mlp.gate_up.weight,
                   layer.mlp.down.weight] for layer in drafter.layers]
        self.decoder = kernel.Decoder(layers, drafter.norm.weight, drafter.rope_cos.float(), drafter.rope_sin.float(),
                                      c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        self.isa = kernel.isa

    @staticmethod
    def accepts(B: int, n: int, cache: KVCache) -> bool:
        """Whether B blocks of n tokens over `cache` run here (else eager)."""
        return cache.k.dtype == torch.float32 and B * n <= MAX_ROWS

    def forward(self, x: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Block embeddings x `[B, n, H]` at positions `ctx_lens[b] .. +n−1` of `slots[b]`, seeing the
        cached context `< ctx_lens[b]` → final-normed hidden `[B, n, H]`. The cache is not written."""
        B, n, H = x.shape
        assert self.accepts(B, n, cache)
        positions = ctx_lens.view(-1, 1) + torch.arange(n)  # [B, n]
        hidden, _ = self.decoder.forward(x.reshape(B * n, H), slots, positions, cache.k, cache.v, [], block=True)
        return hidden.view(B, n, H)

    def write_context(self, fused: torch.Tensor, slots: list[int], starts: list[int], cache: KVCache) -> None:
        """Every layer's context key/value of fused features `[B, n, H]` into `cache` at positions
        `starts[b] .. +n−1` of `slots[b]` (the fp32 cache the kernel reads)."""
        B, n, H = fused.shape
        assert cache.k.dtype == torch.float32
        positions = torch.tensor(starts).view(-1, 1) + torch.arange(n)  # [B, n]
        self.decoder.context(fused.reshape(B * n, H), torch.tensor(slots), positions, cache.k, cache.v)


def shape_fits(c: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can run layers of this shape: on the CPU, every matrix's input a multiple
    of 32, and heads a multiple of 16 up to 128 (its attention tiles)."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and c.head_dim % 16 == 0
            and c.head_dim <= 128 and all(d % 32 == 0 for d in (c.hidden_size, c.q_size, c.intermediate_size)))


def supports(model: torch.nn.Module) -> bool:
    """Whether the kernel can run this model (`shape_fits`, and NVFP4 matrices in chunks of 64 inputs)."""
    nvfp4_fits = all(layer.get_submodule(name).q.shape[1] % FP4_CHUNK == 0 for layer in model.layers
                     for name in _MATRICES if hasattr(layer.get_submodule(name), "q"))
    return shape_fits(model.config, model.device, model.dtype) and nvfp4_fits


def fused_drafter(drafter: torch.nn.Module) -> FusedDrafter | None:
    """The kernel's pass for this drafter where the kernels load and fit it, else None."""
    w = drafter.fc.weight
    kernel = load() if shape_fits(drafter.config.model_config, w.device, w.dtype) else None
    return FusedDrafter(kernel, drafter) if kernel is not None else None


def attach(model: torch.nn.Module) -> None:
    """Give `model` a `FusedDecoder` when the kernels load and fit it, else None."""
    kernel = load() if supports(model) else None
    model.fused_decoder = FusedDecoder(kernel, model) if kernel is not None else None

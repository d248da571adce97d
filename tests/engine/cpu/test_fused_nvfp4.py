"""An NVFP4 target in the C++ decoder: the fused pass against the eager NVFP4 model (same dequantized
weights, fp32), rows and blocks independent of their batch bit for bit, greedy speculation
token-identical to plain decoding, the LM head on the kernel, and where the kernel does not apply.
Every test runs once per kernel build this CPU executes (`kernel_isa`)."""

import copy
from pathlib import Path

import pytest
import torch

from specloop.engine.cpu.fused_decode import MAX_DECODE_ROWS, supports
from specloop.engine.cpu.linear import FP4_ROWS, CpuNvfp4Linear, optimize_for_cpu_inference
from specloop.engine.loaders.load import load_model
from specloop.engine.model.config import ModelConfig
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.nvfp4_embedding import Nvfp4Embedding
from specloop.engine.model.nvfp4_linear import Nvfp4Linear, apply_nvfp4, linear_modules
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.kernels.cpu_decode import cpu_plan
from specloop.kernels.nvfp4 import quantize
from tests.dflash_helpers import plain_and_speculative, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("kernel_isa")

MAX_LEN = 64
CPU = torch.device("cpu")
# Of the reference's largest magnitude: int8 activations (about 2^-9 per product) through two layers.
TOLERANCE = 2e-2


def to_nvfp4(model: Transformer, lm_head: bool = True, embedding: bool = False) -> Transformer:
    weights = {name: quantize(m.weight) for name, m in linear_modules(model).items() if lm_head or name != "lm_head"}
    apply_nvfp4(model, weights | ({"embed": quantize(model.embed.weight)} if embedding else {}))
    return model


def fused_and_reference(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Transformer, Transformer]:
    """The NVFP4 model with the kernel attached, and an eager fp32 copy of it (dequantized weights)."""
    nvfp4 = to_nvfp4(load_model(path, dtype, CPU).model.requires_grad_(False))
    reference = copy.deepcopy(nvfp4).float()
    fused = optimize_for_cpu_inference(nvfp4)
    assert fused.fused_decoder is not None and fused.fused_decoder.isa == cpu_plan().isa
    assert isinstance(fused.lm_head, CpuNvfp4Linear) and isinstance(reference.lm_head, Nvfp4Linear)
    return fused, reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_nvfp4_matches_the_eager_model(tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    fused, reference = fused_and_reference(tiny_llama_dir, dtype)
    tokens = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))
    passes = [([1, 0], [0, 0], 5), ([1, 0], [5, 5], 1), ([0, 1], [6, 6], 1)]
    caches = {id(m): KVCache(m.config, 2, MAX_LEN, torch.float32, CPU) for m in (fused, reference)}
    with torch.inference_mode():
        for slots, starts, n in passes:
            batch = AttnBatch.build(slots, starts, n, CPU, MAX_LEN)
            x = tokens[:, starts[0]:starts[0] + n]
            (got, _), (want, _) = (m(x, caches[id(m)], batch) for m in (fused, reference))
            assert (got.float() - want).abs().max() <= TOLERANCE * want.abs().max()
            got_logits, want_logits = fused.logits(got), reference.logits(want)
            assert (got_logits - want_logits).abs().max() <= TOLERANCE * want_logits.abs().max()


def test_a_token_does_not_depend_on_its_batch_or_block(tiny_llama_dir: Path) -> None:
    model, _ = fused_and_reference(tiny_llama_dir)
    tokens = torch.randint(0, 300, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        caches = [KVCache(model.config, 2, MAX_LEN, torch.float32, CPU) for _ in range(2)]
        for cache in caches:
            model(tokens[:, :8], cache, AttnBatch.build([0, 1], [0, 0], 8, CPU, MAX_LEN))
        block, _ = model(tokens[:, 8:], caches[0], AttnBatch.build([0, 1], [8, 8], 6, CPU, MAX_LEN))
        alone = [model(tokens[:1, p:p + 1], caches[1], AttnBatch.build([0], [p], 1, CPU, MAX_LEN))[0]
                 for p in range(8, 14)]
    assert torch.equal(block[:1], torch.cat(alone, dim=1))
    head_rows = model.logits(block.reshape(-1, block.shape[-1]))
    assert torch.equal(head_rows[:1], model.logits(block[0, :1]))
    # Any pass the fused decoder takes (a verify pass of 8 sequences x 4 rows, 64 decode steps): the
    # NVFP4 head's rows as alone, which they were not while passes of over 16 rows read the dense head.
    hidden = torch.randn(MAX_DECODE_ROWS, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for rows in (17, 32, MAX_DECODE_ROWS):
        assert torch.equal(model.logits(hidden[:rows])[rows - 1], model.logits(hidden[rows - 1:rows])[0]), rows


def test_greedy_speculation_is_lossless(tiny_llama_dir: Path) -> None:
    model, _ = fused_and_reference(tiny_llama_dir, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(0, 300, (4,), generator=g).tolist() * 4)[:14] for _ in range(3)]
    plain, out = plain_and_speculative(model, prompts, NgramProposer(block_size=4), 20, MAX_LEN)
    assert [s.output_ids for s in out] == plain
    assert sum(s.spec.accepted_tokens for s in out) > 0


@pytest.mark.parametrize("embedding", [False, True])
def test_greedy_dflash_speculation_is_lossless_on_an_nvfp4_target(embedding: bool) -> None:
    """The drafter reads the NVFP4 target's taps from the kernel's pass (and, with an NVFP4
    embedding, its block embeddings from the NVFP4 lookup); whatever it drafts, the output is the
    NVFP4 target's own greedy output."""
    target = optimize_for_cpu_inference(to_nvfp4(tiny_target(hidden=64).requires_grad_(False), embedding=embedding))
    assert target.fused_decoder is not None and isinstance(target.embed, Nvfp4Embedding) == embedding
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17, 4)]
    proposer = DFlashProposer(tiny_drafter(target, block_size=4, num_layers=2), target)
    plain, out = plain_and_speculative(target, prompts, proposer, 24, MAX_LEN)
    assert [s.output_ids for s in out] == plain
    assert proposer.fused is not None and sum(s.spec.drafts for s in out) > 0


def test_large_passes_use_the_dense_weight(tiny_llama_dir: Path) -> None:
    fused, reference = fused_and_reference(tiny_llama_dir)
    hidden = torch.randn(FP4_ROWS + 1, fused.config.hidden_size)
    assert torch.allclose(fused.logits(hidden), reference.logits(hidden), atol=1e-5)


def test_the_kernel_needs_inputs_in_chunks_of_64() -> None:
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, max_position=64)
    model = to_nvfp4(Transformer(config).eval().requires_grad_(False))
    assert not supports(model)
    optimized = optimize_for_cpu_inference(model)
    assert optimized.fused_decoder is None and optimized.lm_head.kernel is None
    hidden = torch.randn(2, 32)
    assert torch.allclose(optimized.logits(hidden), hidden @ optimized.lm_head.weight.T, atol=1e-5)

"""The fused C++ forward pass against the eager model: tiny random Llama, Qwen2 and Qwen3, bf16 and fp32.

Checks what the engine relies on: hidden states, taps and cache contents agree with an fp32
reference (same rounded weights) within a tolerance per dtype across decode, multi-token blocks, scattered
slots and ragged starts; a row's result does not depend on the rest of its batch, nor a token's on
the block it is verified in; and greedy
speculation stays token-identical to plain decoding with the kernel in the loop. A DFlash drafter's
context keys/values and block pass agree with the eager drafter's, and a block pass leaves the
context cache as it was. Every test runs once per kernel build this CPU executes (`kernel_isa`).
"""

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specloop.engine.cpu.fused_decode import MAX_ROWS, FusedDecoder, FusedDrafter, supports
from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import load_model
from specloop.engine.model.config import ModelConfig
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sampler import SamplingParams
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.kernels.cpu_decode import cpu_plan
from tests.dflash_helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("kernel_isa")

MAX_LEN = 64
# (slots, starts, new tokens per sequence): prefill-sized blocks, decode, ragged starts, scattered slots.
PASSES = [([2, 0], [0, 0], 7), ([2, 0], [7, 7], 1), ([1], [0], 5), ([0, 1, 2], [8, 5, 8], 1),
          ([2, 1], [9, 6], 4)]


TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # of the reference's largest magnitude


def fused_and_reference(path: Path, dtype: torch.dtype = torch.bfloat16) -> tuple[Transformer, Transformer]:
    """The model in `dtype` with the kernel attached, and an eager fp32 copy of the same (rounded) weights."""
    fused = optimize_for_cpu_inference(load_model(path, dtype, torch.device("cpu")).model)
    assert fused.fused_decoder is not None and fused.fused_decoder.isa == cpu_plan().isa
    reference = copy.deepcopy(load_model(path, dtype, torch.device("cpu")).model).float()
    return fused, reference


def run_passes(model: Transformer,
               tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], KVCache]:
    cache = KVCache(model.config, 3, MAX_LEN, torch.float32, torch.device("cpu"))
    hidden, taps = [], []
    with torch.inference_mode():
        for i, (slots, starts, n) in enumerate(PASSES):
            batch = AttnBatch.build(slots, starts, n, torch.device("cpu"), MAX_LEN)
            h, t = model(tokens[i, :len(slots), :n], cache, batch, taps=(0, 1))
            hidden.append(h.float())
            taps.append([x.float() for x in t])
    return hidden, taps, cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama-rope-yarn"])
def test_matches_fp32_reference(tiny_hf_model: Callable[[str], Path], kind: str, dtype: torch.dtype) -> None:
    fused, reference = fused_and_reference(tiny_hf_model(kind), dtype)
    tokens = torch.randint(0, fused.config.vocab_size, (len(PASSES), 3, 7), generator=torch.Generator().manual_seed(0))
    got, got_taps, got_cache = run_passes(fused, tokens)
    want, want_taps, want_cache = run_passes(reference, tokens)
    for g, w in zip(got + sum(got_taps, []) + [got_cache.k, got_cache.v],
                    want + sum(want_taps, []) + [want_cache.k, want_cache.v]):
        assert (g - w).abs().max() <= TOLERANCE[dtype] * w.abs().max()


def test_wide_decode_step_matches_reference(tiny_llama_dir: Path) -> None:
    fused, reference = fused_and_reference(tiny_llama_dir)
    B = MAX_ROWS + 8  # more sequences than a block may have rows: decode steps still run in the kernel
    fp32_cache = KVCache(fused.config, 1, MAX_LEN, torch.float32, torch.device("cpu"))
    assert FusedDecoder.accepts(B, 1, fp32_cache) and not FusedDecoder.accepts(1, B, fp32_cache)
    g = torch.Generator().manual_seed(3)
    prompt, step = torch.randint(0, 300, (B, 5), generator=g), torch.randint(0, 300, (B, 1), generator=g)
    starts = [5] * B
    got_want = []
    for model in (fused, reference):
        cache = KVCache(model.config, B, MAX_LEN, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            for b in range(B):  # ragged histories: sequence b has only b % 5 + 1 tokens before its step
                n = b % 5 + 1
                starts[b] = n
                model(prompt[b:b + 1, :n], cache, AttnBatch.build([b], [0], n, torch.device("cpu"), MAX_LEN))
            h, _ = model(step, cache, AttnBatch.build(list(range(B)), starts, 1, torch.device("cpu"), MAX_LEN))
        got_want.append(h.float())
    got, want = got_want
    assert (got - want).abs().max() <= TOLERANCE[torch.bfloat16] * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_batch(tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    model, _ = fused_and_reference(tiny_llama_dir, dtype)
    prompt = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        alone = KVCache(model.config, 2, MAX_LEN, torch.float32, torch.device("cpu"))
        together = KVCache(model.config, 2, MAX_LEN, torch.float32, torch.device("cpu"))
        a, _ = model(prompt[:1], alone, AttnBatch.build([0], [0], 6, torch.device("cpu"), MAX_LEN))
        b, _ = model(prompt, together, AttnBatch.build([0, 1], [0, 0], 6, torch.device("cpu"), MAX_LEN))
        assert torch.equal(a[0], b[0])
        step = prompt[:, -1:]
        a, _ = model(step[:1], alone, AttnBatch.build([0], [6], 1, torch.device("cpu"), MAX_LEN))
        b, _ = model(step, together, AttnBatch.build([0, 1], [6, 6], 1, torch.device("cpu"), MAX_LEN))
        assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_a_token_does_not_depend_on_its_block(head_dim: int) -> None:
    """Verify passes (a block of tokens) must give each token bit for bit what one-token decode steps
    give it, or greedy speculation would not be lossless. The context is not a multiple of the
    attention tiles (4 keys, 16 padded), and a 9-token block spans more than one tile of rows. fp32,
    where bf16's rounding of the outputs would hide a difference in the last bits."""
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=2 * head_dim, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=head_dim, max_position=128)
    torch.manual_seed(0)
    model = optimize_for_cpu_inference(Transformer(config).eval().requires_grad_(False))
    assert model.fused_decoder is not None and model.fused_decoder.isa == cpu_plan().isa
    tokens = torch.randint(0, 64, (1, 46), generator=torch.Generator().manual_seed(3))
    cpu = torch.device("cpu")
    with torch.inference_mode():
        caches = [KVCache(config, 1, MAX_LEN, torch.float32, cpu) for _ in range(2)]
        for cache in caches:
            model(tokens[:, :37], cache, AttnBatch.build([0], [0], 37, cpu, MAX_LEN))
        block, _ = model(tokens[:, 37:], caches[0], AttnBatch.build([0], [37], 9, cpu, MAX_LEN))
        steps = [model(tokens[:, p:p + 1], caches[1], AttnBatch.build([0], [p], 1, cpu, MAX_LEN))[0]
                 for p in range(37, 46)]
    assert torch.equal(block, torch.cat(steps, dim=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_speculation_is_lossless(tiny_llama_dir: Path, dtype: torch.dtype) -> None:
    model, _ = fused_and_reference(tiny_llama_dir, dtype)
    g = torch.Generator().manual_seed(2)
    # Repetitive prompts so that n-gram drafts get accepted and rollback paths run.
    prompts = [(torch.randint(0, 300, (4,), generator=g).tolist() * 4)[:14] for _ in range(3)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    plain_engine = LLMEngine(model, EngineConfig(num_slots=3, max_len=MAX_LEN), [])
    plain = [s.output_ids for s in plain_engine.generate(prompts, greedy)]
    spec = LLMEngine(model, EngineConfig(num_slots=3, max_len=MAX_LEN), [], proposer=NgramProposer(block_size=4))
    out = spec.generate(prompts, greedy)
    assert [s.output_ids for s in out] == plain
    assert sum(s.spec.accepted_tokens for s in out) > 0
    assert FusedDecoder.accepts(3, 4, spec.runner.cache)  # every pass above ran through the kernel


def test_bf16_cache_stays_eager(tiny_llama_dir: Path) -> None:
    model, _ = fused_and_reference(tiny_llama_dir)
    cache = KVCache(model.config, 1, MAX_LEN, torch.bfloat16, torch.device("cpu"))
    assert not FusedDecoder.accepts(1, 1, cache)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor([[1, 2, 3]]), cache, AttnBatch.build([0], [0], 3, torch.device("cpu"), MAX_LEN))
    assert hidden.shape == (1, 3, model.config.hidden_size) and cache.k[:, 0, :, :3].abs().sum() > 0


def test_attaches_only_where_it_applies(tiny_llama_dir: Path) -> None:
    unaligned = ModelConfig(arch="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=1,
                            num_heads=4, num_kv_heads=2, head_dim=12, max_position=64)
    assert not supports(Transformer(unaligned).to(torch.bfloat16))
    assert optimize_for_cpu_inference(Transformer(unaligned).eval().requires_grad_(False)).fused_decoder is None
    model = load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu")).model
    assert supports(model)
    assert optimize_for_cpu_inference(model, fused=False).fused_decoder is None


def kernel_target_and_drafter(dtype: torch.dtype) -> tuple[Transformer, DFlashDrafter]:
    """The DFlash tests' tiny target, widened until the kernel takes it, in `dtype` with the kernel
    attached, and a random 2-layer drafter of block 4 for it."""
    target = optimize_for_cpu_inference(tiny_target(hidden=64).to(dtype).requires_grad_(False))
    return target, tiny_drafter(target, block_size=4, num_layers=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_drafter_block_matches_the_eager_drafter(dtype: torch.dtype) -> None:
    """Context written by the kernel, then two blocks in scattered slots with ragged contexts (37 and
    9 positions, so rows of the other slot and past each context hold features the block must not see)."""
    target, drafter = kernel_target_and_drafter(dtype)
    proposer = DFlashProposer(drafter, target)
    assert proposer.fused is not None and proposer.fused.isa == cpu_plan().isa
    proposer.allocate(3, MAX_LEN)
    tokens = torch.randint(0, 64, (3, 40), generator=torch.Generator().manual_seed(4))
    slots, lens = torch.tensor([2, 0]), torch.tensor([37, 9])
    cpu = torch.device("cpu")
    eager = KVCache(drafter.config.model_config, 3, MAX_LEN, torch.float32, cpu)
    with torch.inference_mode():
        _, taps = target(tokens, taps=proposer.tap_layers)
        proposer.observe([0, 1, 2], [0, 0, 0], taps, tokens)
        proposer.write()
        batch = AttnBatch.build([0, 1, 2], [0, 0, 0], 40, cpu, MAX_LEN)
        for layer, (k, v) in enumerate(proposer.drafter.context_kv(proposer.drafter.fuse(taps), batch.positions)):
            eager.write(layer, batch, k, v)
        before = proposer.cache.k.clone(), proposer.cache.v.clone()
        x = proposer.drafter.embed_block(torch.tensor([[5], [7]]), 4, target.embed)  # [2, 4, H]
        got = proposer.fused.forward(x, slots, lens, proposer.cache)
        alone = proposer.fused.forward(x[1:], slots[1:], lens[1:], proposer.cache)
        want = proposer._run_eager(x, slots, lens)
    for got_kv, want_kv in ((before[0], eager.k), (before[1], eager.v)):  # the kernel's context = eager's
        assert (got_kv - want_kv).abs().max() <= TOLERANCE[dtype] * want_kv.abs().max()
    assert torch.equal(proposer.cache.k, before[0]) and torch.equal(proposer.cache.v, before[1])
    assert (got.float() - want.float()).abs().max() <= TOLERANCE[dtype] * want.float().abs().max()
    assert torch.equal(got[1:], alone)
    blocks = MAX_ROWS // 4
    assert FusedDrafter.accepts(blocks, 4, proposer.cache) and not FusedDrafter.accepts(blocks + 1, 4, proposer.cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_dflash_speculation_is_lossless_with_the_kernel(dtype: torch.dtype) -> None:
    target, drafter = kernel_target_and_drafter(dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17, 4)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain = [s.output_ids for s in LLMEngine(target, EngineConfig(num_slots=3, max_len=MAX_LEN), []).generate(
        prompts, greedy)]
    proposer = DFlashProposer(drafter, target)
    out = LLMEngine(target, EngineConfig(num_slots=3, max_len=MAX_LEN), [], proposer=proposer).generate(prompts, greedy)
    assert [s.output_ids for s in out] == plain
    assert proposer.fused is not None and sum(s.spec.drafts for s in out) > 0

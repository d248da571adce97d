"""A target served from GGUF blocks (`--weights gguf`): the C++ decoder and the layers against the eager
fp32 model of the same dequantized weights, rows and blocks independent of their batch bit for bit,
greedy speculation token-identical to plain decoding, and the real SmolLM2 GGUF served from its own
Q4_1 and Q8_0 blocks under the file's fingerprint. Kernel tests run once per build this CPU executes."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import load_for_inference, load_model
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.model.config import ModelConfig
from specloop.engine.model import gguf_linear
from specloop.engine.model.gguf_linear import GgufBlocks, GgufLinear, apply_gguf, stack
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.nvfp4_linear import linear_modules
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sampler import SamplingParams
from specloop.engine.speculation.dflash_proposer import DFlashProposer
from specloop.engine.speculation.ngram import NgramProposer
from specloop.kernels.cpu_decode import cpu_plan, load
from specloop.kernels.cpu_features import CpuPlan
from tests.dflash_helpers import plain_and_speculative, tiny_drafter, tiny_target
from tests.kernels.test_cpu_ggml import Q4_K, Q6_K, k_quant_blocks

MAX_LEN = 64
CPU = torch.device("cpu")
TOLERANCE = 2e-2  # of the reference's largest magnitude: int8 activations through two layers, as for NVFP4
FORMATS = {"attn.qkv": GGMLQuantizationType.Q4_1, "attn.o": GGMLQuantizationType.Q4_0,
           "mlp": GGMLQuantizationType.Q4_1, "lm_head": GGMLQuantizationType.Q8_0}


def to_gguf(model: Transformer) -> tuple[Transformer, Transformer]:
    """`model` with every linear layer in GGUF blocks (Q4_1, Q4_0 and a Q8_0 head, as files mix them),
    optimised for the CPU, and an eager fp32 copy holding the blocks' dequantized weights."""
    reference = copy.deepcopy(model).float()
    blocks = {}
    for name, module in linear_modules(model).items():
        qtype = next(t for key, t in FORMATS.items() if key in name)
        raw = quantize(module.weight.detach().float().numpy(), qtype)
        blocks[name] = GgufBlocks(int(qtype), torch.from_numpy(np.ascontiguousarray(raw)))
        # A new parameter, so that a tied head does not change the reference's embedding.
        reference.get_submodule(name).weight = torch.nn.Parameter(torch.from_numpy(dequantize(raw, qtype)),
                                                                  requires_grad=False)
    apply_gguf(model, blocks, load())
    fused = optimize_for_cpu_inference(model)
    assert fused.fused_decoder is not None and fused.fused_decoder.isa == cpu_plan().isa
    return fused, reference


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dense_prefill", [False, True], ids=["kernel prefill", "dense prefill"])
def test_fused_gguf_matches_the_eager_model(tiny_llama_dir: Path, dtype: torch.dtype, dense_prefill: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    plan = cpu_plan()
    monkeypatch.setattr(gguf_linear, "cpu_plan", lambda: CpuPlan(plan.isa, dense_prefill, dense_prefill, plan.reason))
    fused, reference = to_gguf(load_model(tiny_llama_dir, dtype, CPU).model)
    tokens = torch.randint(0, 300, (2, 90), generator=torch.Generator().manual_seed(0))
    # Prefills of 2 x 19 rows (past the fused pass's 32: the layers' kernel calls) and 2 x 50 (past
    # KERNEL_ROWS: with AMX, the dequantized weights), then decode steps through the fused pass.
    passes = [([1, 0], [0, 0], 19), ([1, 0], [19, 19], 19), ([1, 0], [38, 38], 50), ([1, 0], [88, 88], 1),
              ([0, 1], [89, 89], 1)]
    caches = {id(m): KVCache(m.config, 2, 2 * MAX_LEN, torch.float32, CPU) for m in (fused, reference)}
    with torch.inference_mode():
        for slots, starts, n in passes:
            batch = AttnBatch.build(slots, starts, n, CPU, 2 * MAX_LEN)
            x = tokens[:, starts[0]:starts[0] + n]
            (got, _), (want, _) = (m(x, caches[id(m)], batch) for m in (fused, reference))
            assert (got.float() - want).abs().max() <= TOLERANCE * want.abs().max()
            got_logits, want_logits = fused.logits(got), reference.logits(want)
            assert (got_logits - want_logits).abs().max() <= TOLERANCE * want_logits.abs().max()


@pytest.mark.usefixtures("kernel_isa")
def test_k_quant_layers_match_the_eager_model() -> None:
    """The Q4_K_M mix (Q4_K and Q6_K matrices, a Q6_K head) through the fused pass and the layers, against
    the eager fp32 model of the gguf package's dequantization. Random blocks: the package cannot make
    K-quants, and SmolLM2's 576-wide rows do not split into their 256-weight super-blocks."""
    config = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(config).eval().requires_grad_(False)
    reference = copy.deepcopy(model).float()
    rng, blocks = np.random.default_rng(0), {}
    for name, module in linear_modules(model).items():
        qtype = Q6_K if name.endswith(("attn.o", "mlp.down")) or name == "lm_head" else Q4_K
        raw = k_quant_blocks(tuple(module.weight.shape), qtype, rng)
        blocks[name] = GgufBlocks(int(qtype), torch.from_numpy(raw))
        reference.get_submodule(name).weight = torch.nn.Parameter(torch.from_numpy(dequantize(raw, qtype)),
                                                                  requires_grad=False)
    apply_gguf(model, blocks, load())
    fused = optimize_for_cpu_inference(model)
    assert fused.fused_decoder is not None
    tokens = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(0))
    caches = {id(m): KVCache(config, 1, 128, torch.float32, CPU) for m in (fused, reference)}
    with torch.inference_mode():
        for start, n in ((0, 70), (70, 4), (74, 1)):  # a prefill, a verify-sized pass, a step
            batch = AttnBatch.build([0], [start], n, CPU, 128)
            (got, _), (want, _) = (m(tokens[:, start:start + n], caches[id(m)], batch) for m in (fused, reference))
            got_logits, want_logits = fused.logits(got), reference.logits(want)
            assert (got_logits - want_logits).abs().max() <= TOLERANCE * want_logits.abs().max()


@pytest.mark.usefixtures("kernel_isa")
def test_a_token_does_not_depend_on_its_batch_or_block(tiny_llama_dir: Path) -> None:
    model, _ = to_gguf(load_model(tiny_llama_dir, torch.float32, CPU).model)
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


@pytest.mark.usefixtures("kernel_isa")
def test_greedy_speculation_is_lossless(tiny_llama_dir: Path) -> None:
    model, _ = to_gguf(load_model(tiny_llama_dir, torch.bfloat16, CPU).model)
    g = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(0, 300, (4,), generator=g).tolist() * 4)[:14] for _ in range(3)]
    plain, out = plain_and_speculative(model, prompts, NgramProposer(block_size=4), 20, MAX_LEN)
    assert [s.output_ids for s in out] == plain
    assert sum(s.spec.accepted_tokens for s in out) > 0


def test_greedy_dflash_speculation_is_lossless_on_a_gguf_target() -> None:
    target, _ = to_gguf(tiny_target(hidden=64).requires_grad_(False))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 17, 4)]
    proposer = DFlashProposer(tiny_drafter(target, block_size=4, num_layers=2), target)
    plain, out = plain_and_speculative(target, prompts, proposer, 24, MAX_LEN)
    assert [s.output_ids for s in out] == plain
    assert proposer.fused is not None and sum(s.spec.drafts for s in out) > 0


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0],
                         ids=lambda t: t.name)
def test_the_weight_reads_back_as_the_blocks_dequantized(qtype: GGMLQuantizationType) -> None:
    raw = quantize(np.random.default_rng(0).standard_normal((9, 64)).astype(np.float32), qtype)
    blocks = GgufBlocks(int(qtype), torch.from_numpy(np.ascontiguousarray(raw)))
    reference = torch.from_numpy(dequantize(raw, qtype))
    assert torch.equal(GgufLinear(blocks, None, torch.float32, load()).weight, reference)
    assert torch.equal(GgufLinear(blocks, None, torch.bfloat16, load()).weight, reference.bfloat16())


def test_the_head_never_leaves_the_kernel() -> None:
    """A token's logits do not depend on how many rows the head saw (prompt log-probs ask for a whole
    prefill chunk's), where the layers' large passes take dense weights."""
    target, _ = to_gguf(tiny_target(hidden=64).requires_grad_(False))
    hidden = torch.randn(100, 64)
    assert torch.equal(target.logits(hidden)[:1], target.logits(hidden[:1]))


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="ggml_type: 10 is not a block format"):
        GgufBlocks(10, torch.zeros(4, 84, dtype=torch.uint8))  # Q2_K
    with pytest.raises(ValueError, match=r"raw: expected uint8 \[out, in / 32 x 20\]"):
        GgufBlocks(3, torch.zeros(4, 30, dtype=torch.uint8))
    q4_0 = GgufBlocks(2, torch.zeros(4, 18, dtype=torch.uint8))
    q4_1 = GgufBlocks(3, torch.zeros(4, 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"parts are in \['Q4_0', 'Q4_1'\]"):
        stack([q4_0, q4_1])
    with pytest.raises(ValueError, match=r"parts have \[32, 64\] columns"):
        stack([q4_1, GgufBlocks(3, torch.zeros(4, 40, dtype=torch.uint8))])
    nan_scale = torch.zeros(4, 20, dtype=torch.uint8)
    nan_scale[1, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 0x7E00: NaN
    with pytest.raises(ValueError, match="fp16 scale is NaN or infinite"):
        GgufBlocks(3, nan_scale)
    model = tiny_target(hidden=64)
    with pytest.raises(ValueError, match="do not match the module's"):
        apply_gguf(model, {"lm_head": q4_1}, load())


def test_the_weights_choice_is_checked(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="nvfp4_lm_head: an NVFP4 LM head needs weights='nvfp4'"):
        WeightFormat("gguf", lm_head=True)
    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(tiny_llama_dir, torch.float32, CPU, WeightFormat("gguf"))


def test_smollm2_serves_from_its_own_blocks_under_the_file_fingerprint() -> None:
    """Every linear layer of the shipped GGUF from its Q4_1 (layers) and Q8_0 (tied head) blocks; the
    logits of a prompt match the fp32 dequantized model's, and greedy answers agree."""
    gguf = load_for_inference(None, torch.bfloat16, CPU, WeightFormat("gguf"))
    fp32 = load_for_inference(None, torch.float32, CPU)
    assert gguf.fingerprint == fp32.fingerprint and gguf.weights.card() == {"weights": "gguf"}
    formats = {name: m.ggml_type for name, m in gguf.model.named_modules() if isinstance(m, GgufLinear)}
    assert len(formats) == 4 * 30 + 1 and formats["lm_head"] == 8 and set(formats.values()) == {3, 8}
    prompt = gguf.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    logits = {}
    for name, loaded in (("gguf", gguf), ("fp32", fp32)):
        cache = KVCache(loaded.model.config, 1, 128, torch.float32, CPU)
        with torch.inference_mode():
            hidden, _ = loaded.model(torch.tensor([prompt]), cache, AttnBatch.build([0], [0], len(prompt), CPU, 128))
            logits[name] = loaded.model.logits(hidden[0]).float()
    assert (logits["gguf"] - logits["fp32"]).abs().max() <= 5e-2 * logits["fp32"].abs().max()
    agree = (logits["gguf"].argmax(-1) == logits["fp32"].argmax(-1)).float().mean()
    assert agree >= 0.9, f"the next-token choice agreed at {agree:.0%} of the prompt's positions"
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    answers = [LLMEngine(m.model, EngineConfig(num_slots=1, max_len=256), []).generate([prompt], greedy)[0].output_ids
               for m in (gguf, fp32)]
    # int8 activations round differently from fp32 ones, so the answers may part at a near tie (the
    # kernel that adds blocks' minima apart from their lanes chose the fp32 model's third token, 0.26
    # below its first, at token 7).
    # Where they part, the fp32 model must rate gguf's choice within 2% of its own.
    same = next((i for i, (a, b) in enumerate(zip(*answers)) if a != b), len(answers[1]))
    assert same >= 4, f"the answers parted at token {same}"
    if same < len(answers[1]):
        cache = KVCache(fp32.model.config, 1, 128, torch.float32, CPU)
        ids = torch.tensor([prompt + answers[1][:same]])
        with torch.inference_mode():
            hidden, _ = fp32.model(ids, cache, AttnBatch.build([0], [0], ids.shape[1], CPU, 128))
            last = fp32.model.logits(hidden[0, -1:]).float()[0]
        assert last[answers[1][same]] - last[answers[0][same]] <= 0.02 * last.max().abs()

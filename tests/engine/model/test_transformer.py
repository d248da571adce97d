"""Our loaders + `Transformer` against transformers' own model on the same files, in fp32.

Logits must agree to 1e-4 of the logit scale (max |logit| of the reference), with and without the
KV cache; greedy generations of 64 tokens must be token-identical to transformers' `generate`.
Covers the real SmolLM2 GGUF (transformers dequantizes it itself) and tiny random Llama, Qwen2,
Qwen3 and RoPE-scaled Llama directories, one of them sharded.
"""

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import LoadedModel, load_model
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.engine.model.transformer import Transformer

CPU = torch.device("cpu")
NEW_TOKENS = 64
TINY_KINDS = ["llama", "llama-sharded", "qwen2", "qwen3", "llama-rope-linear", "llama-rope-llama3", "llama-rope-yarn"]


def greedy(model: Transformer, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Prefill once, then decode one token per pass through the KV cache; stop after an eos id."""
    max_len = len(prompt) + max_new
    cache = KVCache(model.config, num_slots=1, max_len=max_len, dtype=model.dtype, device=model.device)
    tokens, start, out = prompt, 0, []
    with torch.no_grad():
        while len(out) < max_new:
            batch = AttnBatch.build([0], [start], len(tokens), model.device, max_len)
            hidden, _ = model(torch.tensor([tokens], device=model.device), cache, batch)
            nxt = int(model.logits(hidden[:, -1]).argmax(-1))
            out.append(nxt)
            if nxt in eos:
                break
            start, tokens = start + len(tokens), [nxt]
    return out


def reference_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4 * scale, f"max |diff| {diff:.3g} > 1e-4 x logit scale {scale:.3g}"


def cached_logits(model: Transformer, tokens: list[int], split: int) -> torch.Tensor:
    """Logits `[n, V]` from a prefill of `tokens[:split]` then one pass per remaining token."""
    cache = KVCache(model.config, num_slots=1, max_len=len(tokens), dtype=model.dtype, device=model.device)
    chunks = [tokens[:split]] + [[t] for t in tokens[split:]]
    rows, start = [], 0
    for chunk in chunks:
        batch = AttnBatch.build([0], [start], len(chunk), model.device, len(tokens))
        hidden, _ = model(torch.tensor([chunk]), cache, batch)
        rows.append(model.logits(hidden[0]))
        start += len(chunk)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2: LoadedModel) -> list[int]:
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of copper."}])
    return smollm2.tokenizer.encode(text)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_smollm2_logits_match_transformers(smollm2: LoadedModel, smollm2_reference: torch.nn.Module,
                                           smollm2_prompt: list[int]) -> None:
    with torch.no_grad():
        ref = smollm2_reference(torch.tensor([smollm2_prompt])).logits[0]
        hidden, _ = smollm2.model(torch.tensor([smollm2_prompt]))
        assert_logits_close(smollm2.model.logits(hidden[0]), ref)
        assert_logits_close(cached_logits(smollm2.model, smollm2_prompt, split=len(smollm2_prompt) - 4), ref)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_smollm2_greedy_matches_transformers_generate(smollm2: LoadedModel, smollm2_reference: torch.nn.Module,
                                                      smollm2_prompt: list[int]) -> None:
    ours = greedy(smollm2.model, smollm2_prompt, NEW_TOKENS, set(smollm2.tokenizer.eos_token_ids))
    assert ours == reference_greedy(smollm2_reference, smollm2_prompt, NEW_TOKENS)
    assert len(ours) > 8, "the comparison should cover a real answer, not an immediate stop"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_smollm2_served_path_greedy_matches_transformers_generate(
        smollm2: LoadedModel, smollm2_reference: torch.nn.Module, smollm2_prompt: list[int]) -> None:
    """The model as `specloop serve` runs it on this CPU: optimised linears and, where the kernels
    build, the fused C++ decode pass (engine/cpu/fused_decode.py)."""
    served = optimize_for_cpu_inference(copy.deepcopy(smollm2.model))
    ours = greedy(served, smollm2_prompt, NEW_TOKENS, set(smollm2.tokenizer.eos_token_ids))
    assert ours == reference_greedy(smollm2_reference, smollm2_prompt, NEW_TOKENS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_matches_transformers(tiny_hf_model: Callable[[str], Path], kind: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_hf_model(kind)
    ours = load_model(path, torch.float32, CPU)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 96 positions reach past the 64-token original context of the llama3 and yarn variants.
    tokens = torch.randint(3, ours.model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0]
        hidden, _ = ours.model(torch.tensor([tokens]))
        assert_logits_close(ours.model.logits(hidden[0]), ref)
        assert_logits_close(cached_logits(ours.model, tokens, split=80), ref)
    prompt = tokens[:16]
    eos = set(ref_model.generation_config.eos_token_id if isinstance(ref_model.generation_config.eos_token_id, list)
              else [ref_model.generation_config.eos_token_id])
    assert greedy(ours.model, prompt, NEW_TOKENS, eos) == reference_greedy(ref_model, prompt, NEW_TOKENS)

"""Log-probabilities from the engine: the log-softmax of the target's logits from a separate forward
pass, identical with speculation on and off (greedy), prompt log-probabilities for echo, and
scoring a prompt without generating."""

from pathlib import Path

import pytest
import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import load_model
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.ngram import NgramProposer

MAX_LEN = 96


@pytest.fixture
def model(tiny_llama_dir: Path, kernel_isa: object) -> torch.nn.Module:
    return optimize_for_cpu_inference(load_model(tiny_llama_dir, torch.float32, torch.device("cpu")).model)


def reference(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log-softmax `[len(prompt + output), V]` of one cache-free forward pass over the whole text."""
    with torch.inference_mode():
        hidden, _ = model(torch.tensor([prompt + output]))
        return torch.log_softmax(model.logits(hidden[0]), dim=-1)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 300, (4,), generator=g).tolist() * 4)[:14] for _ in range(3)]


def test_logprobs_are_the_targets_and_equal_with_speculation(model: torch.nn.Module) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, prompt_logprobs=2)
    plain = LLMEngine(model, EngineConfig(num_slots=3, max_len=MAX_LEN), []).generate(prompts(), params)
    spec_engine = LLMEngine(model, EngineConfig(num_slots=3, max_len=MAX_LEN), [], proposer=NgramProposer(block_size=4))
    spec = spec_engine.generate(prompts(), params)
    assert sum(s.spec.accepted_tokens for s in spec) > 0  # drafts were accepted, so verify rows were used
    for p, s in zip(plain, spec):
        assert p.output_ids == s.output_ids
        # The rows come from passes of other sizes: the C++ decoder gives a token the same hidden state
        # whatever its pass, but an LM head over more rows than its kernel takes sums in another order.
        for a, b in zip(p.logprobs, s.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        ref = reference(model, p.prompt_ids, p.output_ids)
        n = len(p.prompt_ids)
        for i, lp in enumerate(p.logprobs):
            row = ref[n - 1 + i]
            assert lp.token_id == p.output_ids[i] and abs(lp.logprob - row[lp.token_id].item()) < 1e-4
            assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert p.prompt_logprobs[0] is None and len(p.prompt_logprobs) == n
        for j, lp in enumerate(p.prompt_logprobs[1:], start=1):
            assert lp.token_id == p.prompt_ids[j] and abs(lp.logprob - ref[j - 1, lp.token_id].item()) < 1e-4
            assert len(lp.top) == 2


def test_prompt_logprobs_across_prefill_chunks(model: torch.nn.Module) -> None:
    prompt = prompts()[0] * 3  # 42 tokens in chunks of 16
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine = LLMEngine(model, EngineConfig(num_slots=1, max_len=MAX_LEN, max_prefill_tokens=16), [])
    (seq,) = engine.generate([prompt], params)
    ref = reference(model, prompt, [])
    assert [lp.token_id for lp in seq.prompt_logprobs[1:]] == prompt[1:]
    assert max(abs(lp.logprob - ref[j, prompt[j + 1]].item()) for j, lp in enumerate(seq.prompt_logprobs[1:])) < 1e-4


def test_max_tokens_zero_scores_the_prompt_only(model: torch.nn.Module) -> None:
    (seq,) = LLMEngine(model, EngineConfig(num_slots=1, max_len=MAX_LEN), []).generate(
        prompts()[:1], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert seq.output_ids == [] and seq.finish_reason == "length" and len(seq.prompt_logprobs) == 14


def test_log_probability_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)

"""Suffix decoding on the real SmolLM2 (bf16, the CPU kernels): alone and with the shipped drafter, at
batch 1 and 8, every greedy answer equals plain decoding's, while the tenant's cache, warmed by earlier
answers, makes the repeated ones draft far ahead."""

from pathlib import Path

import pytest
import torch

from specloop.daemon.shipped_drafters import shipped_drafters
from specloop.daemon.training.prompts import prompt_set
from specloop.engine.loaders.load import LoadedModel, load_for_inference
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.build import build_proposer
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.engine.speculation.suffix_cache import SuffixCache

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path) -> LoadedModel:
    """SmolLM2 as `specloop serve` loads it: bf16 weights, the fused CPU kernels attached."""
    return load_for_inference(smollm2_gguf, torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["suffix", "dflash+suffix"])
def test_suffix_decoding_on_smollm2_is_lossless_at_batch_1_and_8(served: LoadedModel, kind: str) -> None:
    tok = served.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(list(p.messages))) for p in prompt_set("formal-logic")[:8]]
    plain = [s.output_ids for s in LLMEngine(served.model, EngineConfig(num_slots=8, max_len=1024),
                                             tok.eos_token_ids).generate(prompts, GREEDY)]
    drafter = None
    if kind != "suffix":
        drafter = load_drafter(shipped_drafters()[served.fingerprint], served.fingerprint, served.model.device,
                               served.model.dtype).drafter
    for slots in (1, 8):
        cache = SuffixCache()
        cache.add("", prompts[0] + plain[0])  # an earlier request of the same tenant
        engine = LLMEngine(served.model, EngineConfig(num_slots=slots, max_len=1024), tok.eos_token_ids,
                           build_proposer(kind, served.model, drafter, suffix_cache=cache))
        done = engine.generate(prompts, GREEDY)
        assert [s.output_ids for s in done] == plain, f"{kind} at batch {slots}"
        assert done[0].spec.mean_accepted_length > 2, done[0].spec  # its answer was in the cache

"""Structured output in the engine: every answer is JSON valid against its schema, greedy output is
token for token what masked plain decoding gives with speculation on and off, drafts outside the
grammar are only rejected, and a schema the grammar compiler cannot use is refused."""

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from specloop.engine.cpu.linear import optimize_for_cpu_inference
from specloop.engine.loaders.load import LoadedModel, load_model
from specloop.engine.runtime.grammar import GrammarCompiler
from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.sequence import SamplingParams
from specloop.engine.speculation.ngram import NgramProposer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}}
MAX_LEN = 128


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    loaded = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    optimize_for_cpu_inference(loaded.model)
    return loaded


def run(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, speculate: bool) -> list[list[int]]:
    compiler = GrammarCompiler(loaded.tokenizer)
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=4, max_len=MAX_LEN), loaded.tokenizer.eos_token_ids,
                       proposer=NgramProposer(block_size=4) if speculate else None)
    seqs = engine.generate(prompts, params, [compiler.json_schema(SCHEMA) for _ in prompts])
    assert all(s.finish_reason == "stop" for s in seqs), [s.finish_reason for s in seqs]
    return [s.output_ids for s in seqs]


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 300, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def answers(loaded: LoadedModel, outputs: list[list[int]]) -> list[object]:
    return [json.loads(loaded.tokenizer.decode(ids)) for ids in outputs]


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_validates_against_the_schema(loaded: LoadedModel, temperature: float, speculate: bool) -> None:
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=3)
    for answer in answers(loaded, run(loaded, prompts(100), params, speculate)):
        jsonschema.validate(answer, SCHEMA)


def test_greedy_output_is_masked_plain_decoding_with_speculation(loaded: LoadedModel) -> None:
    params = SamplingParams(max_tokens=60, temperature=0.0)
    # Prompts that repeat themselves, so n-gram drafts are proposed, some of them outside the grammar.
    repeated = [p * 3 for p in prompts(8)]
    plain, spec = run(loaded, repeated, params, False), run(loaded, repeated, params, True)
    assert plain == spec


def test_a_schema_the_compiler_cannot_use_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="JSON schema"):
        GrammarCompiler(loaded.tokenizer).json_schema({"type": "objectx"})

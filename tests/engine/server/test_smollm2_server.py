"""The real SmolLM2 behind the real server: a greedy chat completion equals transformers' `generate`
on the same weights (`benchmarks/transformers_reference.py`)."""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from benchmarks.transformers_reference import transformers_llama
from specloop.engine.loaders.load import LoadedModel, read_stored_model
from tests.engine.server.conftest import RunningServer, serving

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NEW_TOKENS = 12
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_server(smollm2: LoadedModel) -> Iterator[RunningServer]:
    with serving(smollm2, None) as running:
        yield running


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_gguf: Path) -> torch.nn.Module:
    return transformers_llama(read_stored_model(smollm2_gguf)[1])


def test_greedy_chat_equals_transformers(smollm2_server: RunningServer, transformers_smollm2: torch.nn.Module) -> None:
    tok = smollm2_server.loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    with torch.no_grad():
        out = transformers_smollm2.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            eos_token_id=list(tok.eos_token_ids), pad_token_id=tok.eos_token_ids[0])
    expected = tok.decode(out[0, len(prompt):].tolist())

    client = openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=smollm2_server.model, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                       temperature=0)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == expected
    assert "Paris" in expected

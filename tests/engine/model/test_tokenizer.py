"""Our tokenizers and chat templates against transformers' on the same files: ids and text must be identical.

SmolLM2's tokenizer is rebuilt from GGUF metadata by us and by transformers independently; the tiny
directory's comes from `tokenizer.json`. Texts cover unicode, code, digits, whitespace runs and
special tokens written in the text.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from specloop.engine.loaders.hf import read_hf_tokenizer
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.model.config import ModelConfig
from specloop.engine.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\n\n\nthree blank\r\nwindows\ttab\t\tdouble",
    "Ünïcödé: naïve café, 東京タワー, Привет мир, مرحبا, 🙂👍🏽 and a lone combining é.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers 1234567890, 3.14159, -42, 1e-5, 2024-11-29, x1y22z333",
    "Contractions: don't, I'm, they're, we've, she'll, he'd; CAPS: DON'T",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n<|endoftext|>",
    "{\"json\": [1, 2, {\"nested\": null}], 'quote': \"\\u00e9\"}",
    "",
    " ",
    "\n",
    "a" * 300,
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Write code:\n```py\nx = 1\n```"}],
]


@pytest.fixture(scope="module")
def smollm2_reference_tokenizer(smollm2_gguf: Path) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def assert_same_as_reference(ours: Tokenizer, ref: "PreTrainedTokenizerBase") -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
    for messages in CHATS:
        for add_generation_prompt in (True, False):
            prompt = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            expected = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            assert prompt == expected
            assert ours.encode(prompt) == ref.encode(expected, add_special_tokens=False)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_smollm2_tokenizer_matches_transformers(smollm2: LoadedModel,
                                               smollm2_reference_tokenizer: "PreTrainedTokenizerBase") -> None:
    ours = smollm2.tokenizer
    assert_same_as_reference(ours, smollm2_reference_tokenizer)
    assert ours.vocab_size == len(smollm2_reference_tokenizer) == 49152
    assert ours.eos_token_ids == (smollm2_reference_tokenizer.eos_token_id,)
    assert ours.id_to_token(2) == "<|im_end|>"
    # Special tokens written in the text stay whole: one id each.
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]


@pytest.mark.timeout(60)
def test_hf_dir_tokenizer_matches_transformers(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = read_hf_tokenizer(tiny_llama_dir, _config(tiny_llama_dir))
    assert_same_as_reference(ours, AutoTokenizer.from_pretrained(tiny_llama_dir))
    assert ours.special_tokens["bos_token"] == "<|im_start|>"
    assert ours.eos_token_ids == (2,)


def _config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


@pytest.mark.timeout(30)
def test_chat_template_errors_become_value_errors(tiny_llama_dir: Path) -> None:
    ours = read_hf_tokenizer(tiny_llama_dir, _config(tiny_llama_dir))
    with pytest.raises(ValueError, match="messages"):
        ours.apply_chat_template([{"role": "user"}])  # no content: the template fails on None + str
    strict = Tokenizer(ours.backend, "{{ raise_exception('roles must alternate') }}", ours.special_tokens, (2,))
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
    bare = Tokenizer(ours.backend, None, ours.special_tokens, (2,))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.timeout(30)
def test_template_context_matches_transformers_environment(tiny_llama_dir: Path) -> None:
    ours = read_hf_tokenizer(tiny_llama_dir, _config(tiny_llama_dir))
    template = ("{{ bos_token }}{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
                "{% if add_generation_prompt %}{{ eos_token }}{% endif %}")
    rendered = Tokenizer(ours.backend, template, ours.special_tokens, (2,)).apply_chat_template(
        [{"role": "user", "content": "<b>&'é"}])
    # tojson must not HTML-escape and must keep non-ASCII as is.
    assert rendered == '<|im_start|>{"role": "user", "content": "<b>&\'é"}\n<|im_end|>'

"""A tiny random Hugging Face Llama (or Qwen) on disk, written through the real file formats.

Tests load these as their models (`tests/model_fixtures.py`), and the capture benchmark serves one
so that what it measures is the capture path, not the model. Kinds: `llama`, `llama-sharded`,
`qwen2`, `qwen3`, `llama-rope-linear`, `llama-rope-llama3`, `llama-rope-yarn`. Every directory
carries a real byte-level BPE tokenizer (trained here on a fixed text, 384 tokens plus ChatML
specials), a ChatML chat template and a generation config, so it loads like a hub checkpoint.

transformers writes them; it is a test dependency, so nothing that serves imports this file.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "Ünïcödé text: naïve café, 東京, emoji 🙂, and numbers 1234567890.",
    "A model that serves traffic keeps its drafter matched to that traffic.\n\n\tTabs and  spaces.",
]

_TINY_COMMON = dict(vocab_size=384 + len(SPECIALS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
_ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def train_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE with 384 learned tokens; ids 0-2 are the ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384 + len(SPECIALS), special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _hf_config(kind: str) -> "PretrainedConfig":
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if kind == "qwen2":
        return Qwen2Config(**_TINY_COMMON, tie_word_embeddings=True)
    if kind == "qwen3":
        # head_dim differs from hidden_size / heads (64 / 4 = 16) on purpose.
        return Qwen3Config(**_TINY_COMMON, head_dim=32, tie_word_embeddings=False)
    if kind == "llama-deep":  # deep enough for a DFlash drafter to tap 3 of its layers (it needs 4)
        return LlamaConfig(**{**_TINY_COMMON, "num_hidden_layers": 6}, tie_word_embeddings=False)
    rope = _ROPE.get(kind.removeprefix("llama-rope-"))
    extra = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    return LlamaConfig(**_TINY_COMMON, tie_word_embeddings=False, **extra)


def write_tiny_hf_model(path: Path, kind: str) -> Path:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(kind.removesuffix("-sharded")), dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1; perturb them so a misplaced norm shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    shard = {"max_shard_size": "200KB"} if kind.endswith("-sharded") else {}
    model.save_pretrained(path, safe_serialization=True, **shard)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
    tokenizer.save_pretrained(path)
    return path

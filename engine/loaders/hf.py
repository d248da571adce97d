"""Read a Hugging Face model directory into a `StoredModel`: config, weights, tokenizer, chat template.

Expects what `save_pretrained` writes: `config.json`; weights as one `model.safetensors` or shards
listed in `model.safetensors.index.json`; `tokenizer.json`; the chat template in
`chat_template.jinja` (transformers >= 4.47) or in `tokenizer_config.json`; and optionally
`generation_config.json`, whose `eos_token_id` decides when generation stops.

Weights stay in the dtype the files store (cast once, in `load.py`). PyTorch pickles
(`pytorch_model.bin`) are refused: loading them runs arbitrary code.

An NVFP4 checkpoint (either layout of `nvfp4_checkpoint.py`, declared by config.json's
`quantization_config` or ModelOpt's `hf_quant_config.json`) is read into an NVFP4 `StoredModel`, with
the lineage `specloop quantize` records under config.json's `specloop` key. Any other quantization is
refused.

The inverse, for writers of a directory these functions read back: `hf_config` (config.json of a
`ModelConfig`), `write_hf_tokenizer` and `write_json`.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as BackendTokenizer

from specloop.engine.loaders.nvfp4_checkpoint import detect_layout, from_tensors
from specloop.engine.loaders.stored_model import StoredModel, nvfp4_stored_model
from specloop.engine.model.config import ModelConfig
from specloop.engine.model.fingerprint import weights_digest
from specloop.engine.model.tokenizer import Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def read_hf_dir(path: Path) -> StoredModel:
    raw = _read_json(path / "config.json")
    config = ModelConfig.from_hf(raw)
    weights = read_safetensors(path)
    tokenizer = read_hf_tokenizer(path, config)
    quant_file = path / "hf_quant_config.json"
    layout = detect_layout(raw, _read_json(quant_file) if quant_file.is_file() else None)
    if layout is not None:
        quantized, dense = from_tensors(weights, layout)
        lineage = raw.get("specloop") or {}
        return nvfp4_stored_model(config, dense, quantized, tokenizer, path.resolve().name,
                                  lineage.get("source_fingerprint"))
    digest = weights_digest((name, str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy())
                            for name, t in weights.items())
    return StoredModel(config, weights, tokenizer, digest, path.resolve().name)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"model directory {path.parent}: missing {path.name}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single or sharded safetensors model, by name."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            raise ValueError(f"model directory {path}: shard {name} listed in the index is missing")
        weights.update(load_file(path / name))
    return weights


def read_hf_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"model directory {path}: missing tokenizer.json")
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    tok_config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    special = {name: text for name in _SPECIAL_NAMES if (text := _token_text(tok_config.get(name)))}
    eos_ids = _eos_ids(path, config, backend, special.get("eos_token"))
    return Tokenizer(backend, _chat_template(path, tok_config), special, eos_ids)


def _token_text(value: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes a special token either as text or as a serialized AddedToken.
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the served chat uses the one named "default".
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _eos_ids(path: Path, config: ModelConfig, backend: BackendTokenizer, eos_text: str | None) -> tuple[int, ...]:
    """Stop ids: generation_config.json first (what `generate` obeys), then config.json, then the tokenizer's."""
    gen = path / "generation_config.json"
    gen_eos = _read_json(gen).get("eos_token_id") if gen.is_file() else None
    ids = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    ids += list(config.eos_token_ids)
    if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
        ids.append(eos_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A Hugging Face config.json for `config`, with weights stored in `dtype`: what
    `ModelConfig.from_hf` reads back as `config`, and what transformers and vLLM need besides."""
    rope = config.rope_scaling
    d = {
        "architectures": [_ARCH_CLASSES[config.arch]], "model_type": config.arch, "hidden_act": "silu",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None if rope is None else {
            "rope_type": rope.kind, "factor": rope.factor, "original_max_position_embeddings": rope.original_max_position,
            "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow},
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    assert ModelConfig.from_hf(d) == config, "config.json would not read back as the config it was written from"
    return d


def write_hf_tokenizer(path: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json
    (stop ids), so that `read_hf_tokenizer` reads back an equal tokenizer."""
    tokenizer.backend.save(str(path / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    write_json(path / "tokenizer_config.json", tok_config)
    write_json(path / "generation_config.json", {"eos_token_id": list(tokenizer.eos_token_ids)})


def write_json(path: Path, data: dict[str, Any]) -> None:
    """JSON as `save_pretrained` writes it: indented, UTF-8 unescaped."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

"""Read a GGUF file (llama.cpp's format) into a `StoredModel`: config, float weights, tokenizer.

Weights are dequantized on load with the `gguf` package (Q4_1, Q8_0, K-quants, ...) and renamed to
Hugging Face names. For the `llama` architecture, llama.cpp's converter reorders the rows of
q_proj/k_proj so that each head's two rotary halves are interleaved (GPT-J style); we put them
back into Hugging Face's rotate-half order, the layout `engine/model/rope.py` uses. Qwen2/Qwen3 files are
not permuted by the converter, so nothing is undone for them.

The tokenizer is rebuilt from metadata (`tokenizer.ggml.*`) as a byte-level BPE `tokenizers`
object; the pre-tokenizer is chosen from `tokenizer.ggml.pre`, and an unknown one is refused rather
than guessed, since a wrong split silently changes token ids.

`read_gguf_blocks` reads the quantized tensors again as stored, for `--weights gguf`, which serves
them as they are (`engine/model/gguf_linear.py`).

This file does not build the model or choose its dtype (`load.py` does).
"""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from specloop.engine.loaders.stored_model import StoredModel
from specloop.engine.model.config import ModelConfig, RopeScaling
from specloop.engine.model.fingerprint import weights_digest
from specloop.engine.model.gguf_linear import BLOCK_FORMATS, GgufBlocks
from specloop.engine.model.tokenizer import Tokenizer

_ARCHS = ("llama", "qwen2", "qwen3")

_RENAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.", r"model.layers.\1."),
    (r"\.attn_q\.", ".self_attn.q_proj."),
    (r"\.attn_k\.", ".self_attn.k_proj."),
    (r"\.attn_v\.", ".self_attn.v_proj."),
    (r"\.attn_output\.", ".self_attn.o_proj."),
    (r"\.attn_q_norm\.", ".self_attn.q_norm."),
    (r"\.attn_k_norm\.", ".self_attn.k_norm."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.ffn_gate\.", ".mlp.gate_proj."),
    (r"\.ffn_up\.", ".mlp.up_proj."),
    (r"\.ffn_down\.", ".mlp.down_proj."),
]
_KNOWN_TENSOR = re.compile(
    r"^(token_embd|output_norm|output)\.weight$"
    r"|^blk\.\d+\.(attn_[qkv]\.(weight|bias)|attn_output\.weight|attn_[qk]_norm\.weight"
    r"|attn_norm\.weight|ffn_norm\.weight|ffn_(gate|up|down)\.weight)$"
)

# Splitting rules for `tokenizer.ggml.pre`, as in each model's own tokenizer.json (llama.cpp uses the
# same rules under these names). SmolLM2 isolates every digit before the GPT-2 byte-level split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def read_gguf(path: Path) -> StoredModel:
    """Read `path` fully: config from metadata, dequantized float32 weights, tokenizer."""
    try:
        reader = GGUFReader(path)
    except ValueError as e:  # gguf reports a bad magic or a truncated file as ValueError
        raise ValueError(f"{path.name}: not a readable GGUF file ({e})") from e
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    tokenizer = read_gguf_tokenizer(meta, path.name)
    config = _config(meta, arch, {t.name for t in reader.tensors}, tokenizer)
    weights = _weights(reader.tensors, config, path.name)
    digest = weights_digest((t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data)
                            for t in reader.tensors)
    return StoredModel(config, weights, tokenizer, digest, served_name(path))


def read_gguf_blocks(path: Path, config: ModelConfig) -> dict[str, GgufBlocks]:
    """The file's weights in the block formats the CPU kernel reads (`engine/model/gguf_linear.py`), as
    stored, by Hugging Face name; q/k rows back in rotate-half order as `read_gguf` puts them, whole
    rows moved, so each row's blocks are untouched. Tensors in other formats are not in it."""
    blocks = {}
    for t in GGUFReader(path).tensors:
        if int(t.tensor_type) not in BLOCK_FORMATS or t.data.ndim != 2:  # a matrix's rows of blocks
            continue
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [out, row bytes], copied off the map
        try:
            blocks[_hf_name(t.name)] = GgufBlocks(int(t.tensor_type), _unpermute_qk(t.name, raw, config))
        except ValueError as e:
            raise ValueError(f"{path.name}: tensor {t.name}: {e}") from e
    return blocks


def served_name(path: Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`: the quantization suffix is dropped."""
    return re.sub(r"[.-](I?Q\d\w*|BF16|F16|F32)$", "", path.stem, flags=re.IGNORECASE)


class _Metadata:
    """Typed access to GGUF key/value metadata, with errors naming the missing key."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"GGUF metadata: missing key {key!r}")
        return self._fields[key].contents()


def _config(meta: _Metadata, arch: str, tensor_names: set[str], tokenizer: Tokenizer) -> ModelConfig:
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", tokenizer.vocab_size)),
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{arch}.feed_forward_length")),
        num_layers=int(meta.require(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position=int(meta.require(f"{arch}.context_length")),
        rms_norm_eps=float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, tensor_names),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _rope_scaling(meta: _Metadata, arch: str, tensor_names: set[str]) -> RopeScaling | None:
    if "rope_freqs.weight" in tensor_names:
        # llama3-style scaling is stored as a per-frequency factor tensor, not as metadata.
        raise ValueError("GGUF: rope_freqs.weight (llama3 rope scaling in a GGUF) is not supported")
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF metadata: {arch}.rope.scaling.type {kind!r} is not supported")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    return RopeScaling(kind=kind, factor=float(meta.require(f"{arch}.rope.scaling.factor")),
                       original_max_position=None if original is None else int(original))


def _weights(tensors: list[ReaderTensor], config: ModelConfig, file_name: str) -> dict[str, torch.Tensor]:
    unknown = [t.name for t in tensors if not _KNOWN_TENSOR.match(t.name)]
    if unknown:
        raise ValueError(f"{file_name}: unsupported GGUF tensors {unknown[:5]}")
    # numpy's dequantization releases the GIL; two threads cut SmolLM2's 2.2 s roughly in half.
    with ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads()))) as pool:
        arrays = pool.map(lambda t: dequantize(t.data, t.tensor_type), tensors)
        weights = {_hf_name(t.name): _dense(t.name, a, config) for t, a in zip(tensors, arrays)}
    return weights


def _hf_name(gguf_name: str) -> str:
    name = gguf_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def _dense(gguf_name: str, array: np.ndarray, config: ModelConfig) -> torch.Tensor:
    if not array.flags.writeable:
        array = array.copy()  # F32 tensors come back as read-only views of the memory-mapped file
    return _unpermute_qk(gguf_name, torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), config)


def _unpermute_qk(gguf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if config.arch != "llama":
        return weight
    if ".attn_q." in gguf_name:
        return unpermute_rows(weight, config.num_heads)
    if ".attn_k." in gguf_name:
        return unpermute_rows(weight, config.num_kv_heads)
    return weight


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: within each head, rows `[first half | second half]` become interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `permute_rows`: interleaved rotary pairs back to rotate-half order, per head."""
    rows = w.shape[0]
    assert rows % (2 * heads) == 0, f"{rows} rows do not split into {heads} heads of rotary pairs"
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_gguf_tokenizer(meta: _Metadata, file_name: str) -> Tokenizer:
    """A byte-level BPE tokenizer, special tokens and chat template from `tokenizer.*` metadata."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{file_name}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{file_name}: tokenizer.ggml.pre {pre!r} is not supported ({', '.join(_PRE_TOKENIZERS)})")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                          ignore_merges=False))
    backend.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    special = {name: tokens[int(i)] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                      ("unk_token", "unknown"), ("pad_token", "padding"))
               if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None}
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[int(bos_id)]
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, int(bos_id))])
    eos = tuple(dict.fromkeys(int(i) for key in ("eos", "eot", "eom")
                              if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None))
    return Tokenizer(backend, meta.get("tokenizer.chat_template"), special, eos)

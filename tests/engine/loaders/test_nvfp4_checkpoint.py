"""The two NVFP4 checkpoint layouts on disk: tensor names, dtypes and scale conventions, the configs
vLLM reads, both read back to the same weights bit for bit, and what is refused.

Every checkpoint here is the tiny random Llama quantized and written through the real files.
"""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specloop.engine.loaders.hf import read_hf_dir
from specloop.engine.loaders.load import read_stored_model
from specloop.engine.loaders.nvfp4_checkpoint import LAYOUTS, detect_layout, from_tensors, to_tensors
from specloop.engine.loaders.quantize import quantized_stored_model, write_nvfp4_checkpoint
from specloop.engine.loaders.stored_model import StoredModel
from specloop.kernels.nvfp4 import NVFP4Weight, dequantize

pytestmark = pytest.mark.timeout(120)

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def source(tiny_llama_dir: Path) -> StoredModel:
    return read_stored_model(tiny_llama_dir)[1]


@pytest.fixture(scope="module")
def quantized(source: StoredModel) -> StoredModel:
    return quantized_stored_model(source, lm_head=False)


@pytest.fixture(scope="module")
def written(quantized: StoredModel, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The checkpoint of `quantized` in a layout, written once per module."""
    dirs: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in dirs:
            dirs[layout] = tmp_path_factory.mktemp(layout) / "out"
            write_nvfp4_checkpoint(dirs[layout], quantized, layout)
        return dirs[layout]

    return get


def same_bytes(a: NVFP4Weight, b: NVFP4Weight) -> bool:
    return (torch.equal(a.packed, b.packed) and torch.equal(a.tensor_scale, b.tensor_scale)
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)))


def test_both_layouts_read_back_to_identical_weights(quantized: StoredModel, written: Callable[[str], Path]) -> None:
    ct, mo = read_hf_dir(written("compressed-tensors")), read_hf_dir(written("modelopt"))
    assert quantized.nvfp4 is not None and ct.nvfp4 is not None and mo.nvfp4 is not None
    assert ct.nvfp4.keys() == mo.nvfp4.keys() == quantized.nvfp4.keys()
    assert all(same_bytes(ct.nvfp4[n], mo.nvfp4[n]) and same_bytes(ct.nvfp4[n], q)
               for n, q in quantized.nvfp4.items())
    assert ct.weights.keys() == mo.weights.keys() == quantized.weights.keys()
    for name, w in quantized.weights.items():
        assert torch.equal(ct.weights[name], w) and torch.equal(mo.weights[name], w), name
    # The dense copy of a quantized weight is its dequantization, in float32.
    assert torch.equal(ct.weights[f"{Q}.weight"], dequantize(ct.nvfp4[f"{Q}.weight"]))


def test_compressed_tensors_stores_the_inverse_global_scale(source: StoredModel, quantized: StoredModel,
                                                            written: Callable[[str], Path]) -> None:
    tensors = load_file(written("compressed-tensors") / "model.safetensors")
    q = quantized.nvfp4[f"{Q}.weight"]
    global_scale = tensors[f"{Q}.weight_global_scale"]
    assert global_scale.dtype == torch.float32 and global_scale.shape == (1,)
    assert torch.equal(global_scale, torch.reciprocal(q.tensor_scale).reshape(1))
    assert torch.equal(torch.reciprocal(global_scale).reshape(()), q.tensor_scale)  # exact both ways
    # 6 x 448 / amax of the fused q/k/v, which the q_proj's own amax can only undercut.
    amax = max(source.weights[f"model.layers.0.self_attn.{x}_proj.weight"].abs().max() for x in "qkv")
    assert global_scale.item() == pytest.approx(6 * 448 / amax.item(), rel=1e-6)
    assert tensors[f"{Q}.weight_packed"].dtype == torch.uint8 and tensors[f"{Q}.weight_packed"].shape == (64, 32)
    assert tensors[f"{Q}.weight_scale"].dtype == torch.float8_e4m3fn and tensors[f"{Q}.weight_scale"].shape == (64, 4)
    assert not any(n.endswith(("input_global_scale", "input_scale")) for n in tensors)  # weight-only
    assert f"{Q}.weight" not in tensors and "lm_head.weight" in tensors  # the head stays dense by default


def test_modelopt_stores_our_tensor_scale(quantized: StoredModel, written: Callable[[str], Path]) -> None:
    tensors = load_file(written("modelopt") / "model.safetensors")
    q = quantized.nvfp4[f"{Q}.weight"]
    assert tensors[f"{Q}.weight_scale_2"].shape == () and torch.equal(tensors[f"{Q}.weight_scale_2"], q.tensor_scale)
    assert tensors[f"{Q}.weight"].dtype == torch.uint8 and torch.equal(tensors[f"{Q}.weight"], q.packed)
    assert tensors[f"{Q}.weight_scale"].dtype == torch.float8_e4m3fn
    assert not any(n.endswith("input_scale") for n in tensors)


def test_fused_layers_share_one_tensor_scale(written: Callable[[str], Path]) -> None:
    tensors = load_file(written("modelopt") / "model.safetensors")

    def scales(i: int, names: str) -> set[float]:
        return {tensors[f"model.layers.{i}.{n}.weight_scale_2"].item() for n in names.split()}

    for i in range(2):
        assert len(scales(i, "self_attn.q_proj self_attn.k_proj self_attn.v_proj")) == 1
        assert len(scales(i, "mlp.gate_proj mlp.up_proj")) == 1
    # Unfused layers keep their own: o_proj's amax is not q/k/v's.
    assert scales(0, "self_attn.o_proj") != scales(0, "self_attn.q_proj")


def test_configs_are_what_vllm_reads(written: Callable[[str], Path]) -> None:
    ct = json.loads((written("compressed-tensors") / "config.json").read_text())["quantization_config"]
    assert ct["quant_method"] == "compressed-tensors" and ct["format"] == "nvfp4-pack-quantized"
    assert ct["quantization_status"] == "compressed" and ct["ignore"] == ["lm_head"]
    group = ct["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None  # NVFP4A16: weights only
    assert group["weights"] == {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                "symmetric": True, "dynamic": False}
    mo_dir = written("modelopt")
    mo = json.loads((mo_dir / "config.json").read_text())["quantization_config"]
    assert mo["quant_method"] == "modelopt" and mo["quant_algo"] == "W4A16_NVFP4" and mo["ignore"] == ["lm_head"]
    hf_quant = json.loads((mo_dir / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"] == {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                        "exclude_modules": ["lm_head"]}


def test_w4a4_activation_scales_are_dropped(quantized: StoredModel) -> None:
    q = {f"{Q}.weight": quantized.nvfp4[f"{Q}.weight"]}
    for layout, extra in (("compressed-tensors", "input_global_scale"), ("modelopt", "input_scale")):
        tensors = to_tensors(q, layout) | {f"{Q}.{extra}": torch.tensor([1.0])}
        back, rest = from_tensors(tensors, layout)
        assert rest == {} and same_bytes(back[f"{Q}.weight"], q[f"{Q}.weight"])


def test_a_checkpoint_without_quantization_config_but_hf_quant_config_is_modelopt() -> None:
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    assert detect_layout({}, hf_quant) == "modelopt"
    assert detect_layout({"quantization_config": {"quant_method": "modelopt", "quant_algo": "nvfp4"}}, None) == "modelopt"
    assert detect_layout({}, None) is None
    assert LAYOUTS == ("compressed-tensors", "modelopt")


@pytest.mark.parametrize(("quant", "message"), [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format \\['pack-quantized'\\]"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"group_size": 32}}}}, "config_groups.g.weights.group_size is 32"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8' is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size is 32"),
])
def test_other_quantizations_are_refused(quant: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect_layout({"quantization_config": quant}, None)


def test_a_checkpoint_missing_a_scale_or_with_a_bad_one_is_refused(written: Callable[[str], Path],
                                                                   tmp_path: Path) -> None:
    tensors = load_file(written("compressed-tensors") / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensor '{Q}.weight_scale'"):
        from_tensors({n: t for n, t in tensors.items() if n != f"{Q}.weight_scale"}, "compressed-tensors")
    with pytest.raises(ValueError, match=f"{Q}.weight_global_scale: expected one float32 value"):
        from_tensors(tensors | {f"{Q}.weight_global_scale": torch.ones(2)}, "compressed-tensors")
    with pytest.raises(ValueError, match=f"checkpoint tensor {Q}: block_scale"):
        from_tensors(tensors | {f"{Q}.weight_scale": torch.ones(64, 4)}, "compressed-tensors")
    # Read from disk, the same refusal names the tensor.
    d = tmp_path / "ct"
    d.mkdir()
    for f in written("compressed-tensors").iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    save_file({n: t for n, t in tensors.items() if n != f"{Q}.weight_scale"}, d / "model.safetensors")
    with pytest.raises(ValueError, match=f"{Q}.weight_scale"):
        read_hf_dir(d)

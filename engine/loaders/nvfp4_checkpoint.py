"""NVFP4 checkpoint layouts: how a Hugging Face directory names, scales and describes its NVFP4
weights, in the two layouts found in the wild, read and written.

- compressed-tensors (llm-compressor's output, vLLM's `compressed-tensors` method): per quantized
  linear `<prefix>.weight_packed` (uint8 `[N, K/2]`), `<prefix>.weight_scale` (E4M3 `[N, K/16]`) and
  `<prefix>.weight_global_scale` (float32 `[1]`) = 6 x 448 / amax, the inverse of our tensor scale;
  config.json's `quantization_config` says `quant_method: compressed-tensors`, `format:
  nvfp4-pack-quantized`.
- NVIDIA ModelOpt: `<prefix>.weight` (uint8 packed), `<prefix>.weight_scale` (E4M3) and
  `<prefix>.weight_scale_2` (float32, 0-dim) = amax / (6 x 448), ours; `hf_quant_config.json` holds
  `quantization.quant_algo`, and ModelOpt's export repeats it in config.json's `quantization_config`
  with `quant_method: modelopt`.

Both pack codes as `kernels/nvfp4.py` does (even index in the low nibble) and lay out block scales
row-major, so reading is renaming plus, for compressed-tensors, one float32 reciprocal.

We write weight-only NVFP4 (W4A16), the configs vLLM serves without activation scales:
compressed-tensors' NVFP4A16 preset (no `input_activations`, so no `input_global_scale`) and ModelOpt's
`W4A16_NVFP4` (no `input_scale`; its `NVFP4` is W4A4 and needs one). On read, the activation scales of
W4A4 checkpoints are dropped: the engine quantizes weights only.

This file maps tensors and config dicts; it opens no files (`hf.py` reads, `quantize.py` writes).
"""

import logging
from typing import Any, Literal, cast, get_args

import torch

from specloop.kernels.nvfp4 import BLOCK, NVFP4Weight

log = logging.getLogger(__name__)

Layout = Literal["compressed-tensors", "modelopt"]
LAYOUTS: tuple[str, ...] = get_args(Layout)

_CT_FORMAT = "nvfp4-pack-quantized"
_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # W4A4 and weight-only: the same weight tensors
_MODELOPT_ALGO = "W4A16_NVFP4"
# ModelOpt readers (vLLM) recognise the format by `producer.name`; the version says who wrote it.
_MODELOPT_PRODUCER = {"name": "modelopt", "version": "specloop"}
_WEIGHT_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": BLOCK,
                "symmetric": True, "dynamic": False}


def check_layout(layout: str) -> Layout:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    return cast(Layout, layout)


def detect_layout(config: dict[str, Any], hf_quant_config: dict[str, Any] | None) -> Layout | None:
    """The NVFP4 layout that config.json (or ModelOpt's `hf_quant_config.json`) declares; None for a
    dense model. Any other quantization is refused rather than loaded as if it were dense."""
    quant = config.get("quantization_config")
    if quant is None and hf_quant_config is not None:
        quant = {**hf_quant_config, "quant_method": "modelopt"}
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(quant)
        return "compressed-tensors"
    if method in ("modelopt", "modelopt_fp4"):
        _check_modelopt(quant.get("quantization", quant))
        return "modelopt"
    raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                     f"(only NVFP4 weights: compressed-tensors {_CT_FORMAT} or modelopt {'/'.join(_MODELOPT_ALGOS)})")


def _check_compressed_tensors(quant: dict[str, Any]) -> None:
    groups = quant.get("config_groups") or {}
    formats = {quant.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict)}
    if formats - {None} != {_CT_FORMAT}:
        raise ValueError(f"config.json: compressed-tensors format {sorted(formats - {None})} is not supported "
                         f"(only {_CT_FORMAT})")
    for name, group in groups.items():
        group_size = (group.get("weights") or {}).get("group_size")
        if group_size != BLOCK:
            raise ValueError(f"config.json: quantization_config.config_groups.{name}.weights.group_size is "
                             f"{group_size}; NVFP4 needs {BLOCK}")


def _check_modelopt(quant: dict[str, Any]) -> None:
    algo = str(quant.get("quant_algo")).upper()
    if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"ModelOpt quant_algo {quant.get('quant_algo')!r} is not supported "
                         f"(only {', '.join(_MODELOPT_ALGOS)})")
    if quant.get("group_size", BLOCK) != BLOCK:
        raise ValueError(f"ModelOpt group_size is {quant['group_size']}; NVFP4 needs {BLOCK}")


def quantization_config(layout: Layout, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for weight-only NVFP4; `ignore` names the linear modules
    left dense (e.g. `lm_head`)."""
    if layout == "compressed-tensors":
        return {"quant_method": "compressed-tensors", "format": _CT_FORMAT, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": _WEIGHT_ARGS,
                                              "input_activations": None, "output_activations": None,
                                              "format": _CT_FORMAT}},
                "ignore": ignore, "kv_cache_scheme": None}
    return {"quant_method": "modelopt", "quant_algo": _MODELOPT_ALGO, "group_size": BLOCK,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _WEIGHT_ARGS, "input_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None, "producer": _MODELOPT_PRODUCER}


def hf_quant_config(ignore: list[str]) -> dict[str, Any]:
    """ModelOpt's `hf_quant_config.json`, which older readers look for instead of config.json."""
    return {"producer": _MODELOPT_PRODUCER,
            "quantization": {"quant_algo": _MODELOPT_ALGO, "kv_cache_quant_algo": None, "group_size": BLOCK,
                             "exclude_modules": ignore}}


def to_tensors(quantized: dict[str, NVFP4Weight], layout: Layout) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of NVFP4 weights named by Hugging Face weight name (`<prefix>.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for name, q in quantized.items():
        prefix = _prefix(name)
        if layout == "compressed-tensors":
            out |= {f"{prefix}.weight_packed": q.packed, f"{prefix}.weight_scale": q.block_scale,
                    f"{prefix}.weight_global_scale": torch.reciprocal(q.tensor_scale).reshape(1)}
        else:
            out |= {f"{prefix}.weight": q.packed, f"{prefix}.weight_scale": q.block_scale,
                    f"{prefix}.weight_scale_2": q.tensor_scale.clone()}  # fused layers share one tensor
    return out


def from_tensors(tensors: dict[str, torch.Tensor],
                 layout: Layout) -> tuple[dict[str, NVFP4Weight], dict[str, torch.Tensor]]:
    """Split a checkpoint's tensors into NVFP4 weights (by `<prefix>.weight`) and the dense rest."""
    rest = dict(tensors)
    marker, packed_suffix, global_suffix, input_suffix = (
        ("weight_packed", "weight_packed", "weight_global_scale", "input_global_scale")
        if layout == "compressed-tensors" else ("weight_scale_2", "weight", "weight_scale_2", "input_scale"))
    quantized: dict[str, NVFP4Weight] = {}
    dropped = 0
    for prefix in sorted(n.removesuffix("." + marker) for n in tensors if n.endswith("." + marker)):
        packed, block_scale, global_scale = (_take(rest, f"{prefix}.{s}")
                                             for s in (packed_suffix, "weight_scale", global_suffix))
        dropped += rest.pop(f"{prefix}.{input_suffix}", None) is not None
        tensor_scale = _tensor_scale(global_scale, f"{prefix}.{global_suffix}")
        if layout == "compressed-tensors":
            tensor_scale = torch.reciprocal(tensor_scale)
        try:
            quantized[f"{prefix}.weight"] = NVFP4Weight(packed, block_scale, tensor_scale)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {prefix}: {e}") from e
    if dropped:
        log.info("dropped the %d activation scales (%s) of a W4A4 checkpoint: NVFP4 weights only", dropped,
                 input_suffix)
    return quantized, rest


def _prefix(weight_name: str) -> str:
    assert weight_name.endswith(".weight"), weight_name
    return weight_name.removesuffix(".weight")


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint: missing tensor {name!r}")
    return tensors.pop(name)


def _tensor_scale(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.numel() != 1:
        raise ValueError(f"checkpoint tensor {name}: expected one float32 value, got {t.dtype} {tuple(t.shape)}")
    return t.reshape(())

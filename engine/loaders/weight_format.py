"""How the served target holds its weights: the one choice that `--weights`, `--nvfp4-lm-head` and
`--nvfp4-embedding` make, checked once, in the form every command that loads a target passes on.

`auto`, what every command serves unless told otherwise, serves a model in its own format where the
CPU kernels read it: on the CPU, where their AVX2 or AVX-512 build loaded, `gguf` for a GGUF file
whose layers are in one of those block formats and `nvfp4` for an NVFP4 checkpoint (its LM head and
embedding as it holds them); `dense` for anything else. `gguf` decoded 1.97-2.32x bf16 at batch 1 on the AMX Xeon and 1.95-2.63x on the Zen 3
(docs/performance.md, "GGUF weights at their own bits"), and it is the same model. `load.py` resolves
it; a loaded model's format is never `auto`.

`dense` serves the weights as stored, dequantized to the model's dtype where the file is a quantized
GGUF. `gguf` serves a GGUF file's Q4_0, Q4_1, Q8_0, Q4_K and Q6_K tensors as they are, from the CPU kernel's tiles
of their blocks (`engine/model/gguf_linear.py`), and its other tensors densely: the same model as the
file, so the same fingerprint as `dense`. `nvfp4` serves every attention and MLP projection from NVFP4
(`kernels/nvfp4.py`), and the LM head and the token embedding each from NVFP4 or densely, as asked:
the head is a GEMM like the projections (on the CPU one decode step streams its 28M weights, as
many as 8 of SmolLM2's 30 layers), the embedding is a lookup of one row per token, so quantizing
it saves memory and no time. Each NVFP4 choice is another model with its own fingerprint
(`engine/loaders/load.py`), for which drafters are trained apart.

This file imports no torch, so the CLIs can name and check a choice before they load anything; it
does not quantize or load (`quantize.py`, `load.py`).
"""

from dataclasses import dataclass
from typing import Literal, get_args

WeightKind = Literal["auto", "dense", "gguf", "nvfp4"]
WEIGHT_KINDS: tuple[str, ...] = get_args(WeightKind)


@dataclass(frozen=True)
class WeightFormat:
    kind: WeightKind = "dense"
    lm_head: bool = False  # with kind "nvfp4": the LM head in NVFP4 too
    embedding: bool = False  # with kind "nvfp4": the token embedding in NVFP4 too

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weights: {self.kind!r} is not one of {', '.join(WEIGHT_KINDS)}")
        if self.kind != "nvfp4":
            for field, part, asked in (("nvfp4_lm_head", "LM head", self.lm_head),
                                       ("nvfp4_embedding", "embedding", self.embedding)):
                if asked:
                    raise ValueError(f"{field}: an NVFP4 {part} needs weights='nvfp4'")

    def cli_options(self) -> list[str]:
        """The `specloop` options that load a target this way (for a command launched as a child)."""
        return (["--weights", self.kind] + (["--nvfp4-lm-head"] if self.lm_head else [])
                + (["--nvfp4-embedding"] if self.embedding else []))

    def card(self) -> dict[str, object]:
        """The fields `/v1/models` and result files show: the kind, and with NVFP4 which parts are."""
        assert self.kind != "auto", "a loaded model's weights are resolved"
        if self.kind != "nvfp4":
            return {"weights": self.kind}
        return {"weights": self.kind, "nvfp4_lm_head": self.lm_head, "nvfp4_embedding": self.embedding}


DENSE = WeightFormat()  # the library's default: the weights as stored (the commands' is `auto`)


def nvfp4_part(asked: bool, weights: object) -> bool:
    """A settings class's check of one `nvfp4_*` flag against its `weights` setting (read before it),
    so that the error names the flag."""
    if asked and weights != "nvfp4":
        raise ValueError("an NVFP4 part needs weights 'nvfp4'")
    return asked

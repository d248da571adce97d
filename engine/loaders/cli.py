"""`specloop quantize`: convert a model (Hugging Face directory or GGUF) into an NVFP4 checkpoint.

The output is a new Hugging Face directory in either layout (`engine/loaders/nvfp4_checkpoint.py`)
that the loaders read back, `specloop serve --weights nvfp4` serves, and vLLM loads; the embedding
stays dense in it (`--nvfp4-embedding` quantizes it on load). This file only
wires the command to `engine/loaders/quantize.py`; torch and the loaders are imported when it runs,
so `specloop --help` stays fast.
"""

import logging
from pathlib import Path
from typing import Annotated, Literal

import typer

log = logging.getLogger(__name__)

_DEFAULT_SOURCE = "default"


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)


def quantize(
    src: Annotated[str, typer.Argument(help=f"HF model directory or .gguf file ('{_DEFAULT_SOURCE}': the SmolLM2 GGUF)")],
    out: Annotated[Path, typer.Argument(help="New HF directory to write (must not exist, or be empty)")],
    layout: Annotated[Literal["compressed-tensors", "modelopt"], typer.Option(
        help="Checkpoint layout: compressed-tensors (llm-compressor's) or modelopt (NVIDIA ModelOpt's)")]
    = "compressed-tensors",
    lm_head: Annotated[bool, typer.Option("--lm-head/--no-lm-head", help="Quantize the LM head too")] = False,
) -> None:
    """Quantize a model's weights to NVFP4 (weight-only) and write them as a checkpoint."""
    from specloop.engine.loaders.load import read_stored_model
    from specloop.engine.loaders.quantize import check_output_dir, quantized_stored_model, write_nvfp4_checkpoint

    try:
        check_output_dir(out)  # before the seconds of reading and quantizing
        path, source = read_stored_model(None if src == _DEFAULT_SOURCE else src)
        if source.nvfp4 is not None:
            raise ValueError(f"model: {source.name} is already NVFP4")
        log.info("quantizing %s to NVFP4 (%s, LM head %s)", path, layout, "NVFP4" if lm_head else "dense")
        model = quantized_stored_model(source, lm_head)
        write_nvfp4_checkpoint(out, model, layout)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    log.info("wrote %s (base-model fingerprint %s, from %s)", out, model.fingerprint, model.source_fingerprint)

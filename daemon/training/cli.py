"""The drafter commands of `specloop`: `train-drafter` and `eval-drafter`.

`register(app)` adds them to the one typer app (`specloop.daemon.cli`). Each command validates its options,
loads the target once, and calls one function: `Trainer.run` (daemon/training/trainer.py) or
`compare` (daemon/evaluation/replay.py). Results are printed as JSON.

`train-drafter` declares only its own options (data, output, target model, dtype, device, weights); the
training options, with their defaults and help, are `TrainConfig`'s fields
(daemon/training/config.py), turned into typer options here. A caller that launches the command
(the daemon, under torchrun) hands it the whole `TrainConfig` as a file instead: `--config FILE`.

Under `torchrun --nproc-per-node N -m specloop.daemon.cli train-drafter ...` the N processes train one drafter
together (daemon/training/distributed.py); only the main one prints the result.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from specloop.daemon.training.config import Option, TrainConfig
from specloop.engine.loaders.weight_format import WeightFormat, WeightKind

if TYPE_CHECKING:  # the commands import torch only when they run
    from specloop.engine.loaders.load import LoadedModel

_DATA = typer.Option(help="JSONL or Parquet file/directory with prompt_token_ids and response_token_ids")
_MODEL = typer.Option(help="Target model: Hugging Face directory or .gguf file (default: SmolLM2-135M GGUF)")
_DEVICE = typer.Option(help="auto, cpu, cuda, cuda:N (default: auto, a GPU when there is one)")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
# The target's weights (engine/loaders/weight_format.py). An NVFP4 target is another base model (its
# own fingerprint), so data, drafters and τ are its own.
WEIGHTS_OPTION = typer.Option(help="Target weights: auto (the model's own format where the CPU kernels read it, "
                                   "else dense), dense, gguf (a GGUF file's own Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks, "
                                   "CPU), or nvfp4 (projections quantized to NVFP4 on load, or an NVFP4 "
                                   "checkpoint's own)")
NVFP4_LM_HEAD_OPTION = typer.Option("--nvfp4-lm-head/--no-nvfp4-lm-head",
                                    help="With --weights nvfp4, the LM head in NVFP4 too")
NVFP4_EMBEDDING_OPTION = typer.Option("--nvfp4-embedding/--no-nvfp4-embedding",
                                      help="With --weights nvfp4, the token embedding in NVFP4 too")


def weight_format(weights: str, nvfp4_lm_head: bool, nvfp4_embedding: bool) -> WeightFormat:
    """The three options as one checked choice."""
    try:
        return WeightFormat(weights, nvfp4_lm_head, nvfp4_embedding)  # type: ignore[arg-type]
    except ValueError as e:  # an NVFP4 head or embedding without NVFP4 weights
        raise typer.BadParameter(str(e)) from e


def register(app: typer.Typer) -> None:
    app.command("train-drafter")(train_drafter)
    app.command("eval-drafter")(eval_drafter)


def _target(model: str | None, dtype: str, device: str | None, weights: WeightFormat) -> LoadedModel:
    """The frozen target, with CPU-inference linears (the drafter only borrows its weights)."""
    import torch

    from specloop.engine.loaders.load import load_for_inference, resolve_device

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    try:
        return load_for_inference(model, getattr(torch, dtype), resolve_device(device), weights)
    except ValueError as e:  # a model that is not there, a layer NVFP4 cannot hold
        raise typer.BadParameter(str(e)) from e


def _config_options() -> list[tuple[str, Option]]:
    """(field name, how it is offered) of each TrainConfig field that is a `train-drafter` option."""
    return [(f.name, f.metadata["option"]) for f in fields(TrainConfig) if "option" in f.metadata]


def _config_parameters() -> list[inspect.Parameter]:
    """TrainConfig's options as keyword parameters annotated for typer, with the field's default and help."""
    defaults, hints = {f.name: f.default for f in fields(TrainConfig)}, get_type_hints(TrainConfig)
    params = []
    for name, how in _config_options():
        # A default would have to be converted back into the option's unit to be shown.
        assert how.to_field is None or defaults[name] is None, f"{name}: a converted option needs default None"
        kind = hints[name] if how.flag_type is None else how.flag_type
        params.append(inspect.Parameter(how.flag or name, inspect.Parameter.KEYWORD_ONLY, default=defaults[name],
                                        annotation=Annotated[kind, typer.Option(help=how.help)]))
    return params


def _with_config_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with TrainConfig's options in place of its `**options`: typer reads a command's options
    from its signature, so the command's own options stay declared in its `def`, the rest in TrainConfig."""
    own = inspect.signature(command, eval_str=True)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = own.replace(parameters=[*params, *_config_parameters()])
    return command


def _train_config(out: Path | None, config: Path | None, options: dict[str, Any]) -> TrainConfig:
    """The TrainConfig of a `train-drafter` invocation: the `--config` file's, or `--out` and the options
    (ValueError naming the field when it is invalid, or when both are given)."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    values = {}
    for name, how in _config_options():
        value = options[how.flag or name]
        values[name] = value if how.to_field is None or value is None else how.to_field(value)
    if config is None:
        if out is None:
            raise ValueError("--out is required (or --config)")
        return TrainConfig(out_dir=str(out), **values)
    given = sorted(name for name, value in values.items() if value != defaults[name])
    if out is not None or given:
        raise ValueError(f"--config holds the whole training config; leave out --out and {given or 'the options'}")
    return TrainConfig.read(config)


@_with_config_options
def train_drafter(
    data: Annotated[list[Path], _DATA],
    out: Annotated[Path | None, typer.Option(help="Artifact directory (also holds the resumable checkpoint)")] = None,
    config: Annotated[Path | None, typer.Option(
        help="A training config as JSON (TrainConfig.write), in place of --out and the training options")] = None,
    model: Annotated[str | None, _MODEL] = None,
    dtype: str = "float32",
    device: Annotated[str | None, _DEVICE] = None,
    weights: Annotated[WeightKind, WEIGHTS_OPTION] = "auto",
    nvfp4_lm_head: Annotated[bool, NVFP4_LM_HEAD_OPTION] = False,
    nvfp4_embedding: Annotated[bool, NVFP4_EMBEDDING_OPTION] = False,
    **options: Any,  # TrainConfig's options (`_with_config_options`)
) -> None:
    """Train a DFlash drafter on the target's own outputs and write the artifact to OUT."""
    from specloop.daemon.training import distributed
    from specloop.daemon.training.trainer import Trainer
    from specloop.storage.sequences import read_sequences

    try:
        cfg = _train_config(out, config, options)
        sequences = read_sequences(data)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    with distributed.process_group(device) as this_device:
        loaded = _target(model, dtype, this_device, weight_format(weights, nvfp4_lm_head, nvfp4_embedding))
        try:
            trainer = Trainer(cfg, loaded.model, loaded.fingerprint, sequences)
        except ValueError as e:  # unusable data, a checkpoint of another run, a warm start of another shape
            raise typer.BadParameter(str(e)) from e
        result = trainer.run()
        main = distributed.is_main()
    if main:  # one result on stdout, however many processes trained
        typer.echo(json.dumps({
            "artifact": str(result.artifact), "steps": result.steps, "seconds": round(result.seconds, 1),
            "steps_per_second": result.steps_per_second, "train_response_tokens": result.train_tokens,
            "final_train_loss": result.final_train_loss, "best_heldout_loss": result.best_heldout_loss,
            "stop_reason": result.stop_reason, "features": result.features, "history": result.history,
        }, indent=2))
    distributed.end_launched_process()


def eval_drafter(
    data: Annotated[list[Path], _DATA],
    drafter: Annotated[list[Path] | None, typer.Option(help="Drafter artifact directory (repeatable)")] = None,
    ngram: Annotated[bool, typer.Option(help="Include the n-gram lookup baseline")] = True,
    ngram_block_size: Annotated[int | None, typer.Option(
        help="Default: the first drafter's block size, else 8")] = None,
    combined: Annotated[bool, typer.Option(help="Also replay each drafter combined with n-gram lookup")] = True,
    min_match: Annotated[int, typer.Option(help="Combined: n-gram match length that overrides the drafter")] = 3,
    block_size: Annotated[int | None, typer.Option(help="Serve drafters at this (lower) block size")] = None,
    model: Annotated[str | None, _MODEL] = None,
    dtype: str = "float32",
    device: Annotated[str | None, _DEVICE] = None,
    weights: Annotated[WeightKind, WEIGHTS_OPTION] = "auto",
    nvfp4_lm_head: Annotated[bool, NVFP4_LM_HEAD_OPTION] = False,
    nvfp4_embedding: Annotated[bool, NVFP4_EMBEDDING_OPTION] = False,
    limit: Annotated[int | None, typer.Option(help="Use only the first N sequences")] = None,
    batch_size: int = 8,
    generate: Annotated[bool, typer.Option(help="Also measure by real speculative generation on the engine")] = False,
    concurrency: Annotated[int, typer.Option(help="--generate: sequences decoded together")] = 8,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON here")] = None,
) -> None:
    """Tau and per-position acceptance on stored target outputs: replayed, and with --generate also
    measured by real speculative generation."""
    from specloop.daemon.evaluation.replay import compare
    from specloop.engine.speculation.drafter_artifact import read_meta
    from specloop.storage.sequences import read_sequences

    try:
        sequences = read_sequences(data)[:limit]
        drafters = list(drafter or [])
        first_block = read_meta(drafters[0])["config"]["block_size"] if drafters else 8
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if not sequences:
        raise typer.BadParameter("--data holds no sequences")
    if concurrency <= 0:
        raise typer.BadParameter(f"--concurrency must be > 0, got {concurrency}")
    loaded = _target(model, dtype, device, weight_format(weights, nvfp4_lm_head, nvfp4_embedding))
    nb = (ngram_block_size or block_size or first_block) if ngram else None
    try:
        report = compare(loaded.model, loaded.fingerprint, sequences, drafters, nb, combined, block_size,
                         min_match, batch_size, concurrency if generate else None)
    except ValueError as e:  # a drafter for another base model, a block size it was not trained for
        raise typer.BadParameter(str(e)) from e
    text = json.dumps(report, indent=2)
    if output is not None:
        output.write_text(text + "\n")
    typer.echo(text)

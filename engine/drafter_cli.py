"""The drafter commands of `specloop`: `train-drafter` and `eval-drafter`.

`register(app)` adds them to the one typer app (`daemon.cli`). Each command validates its options,
loads the target once, and calls one function: `Trainer.run` (engine/dflash_train.py) or
`acceptance.compare` (engine/acceptance.py). Results are printed as JSON.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

_DATA = typer.Option(help="JSONL or Parquet file/directory with prompt_token_ids and response_token_ids")
_MODEL = typer.Option(help="Target model: Hugging Face directory or .gguf file (default: SmolLM2-135M GGUF)")
_DEVICE = typer.Option(help="cpu, cuda, cuda:N; default cuda when available")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def register(app: typer.Typer) -> None:
    app.command("train-drafter")(train_drafter)
    app.command("eval-drafter")(eval_drafter)


def _target(model: str | None, dtype: str, device: str | None):  # noqa: ANN202 (LoadedModel, imported lazily)
    """The frozen target, with CPU-inference linears (the drafter only borrows its weights)."""
    import torch

    from engine.cpu_linear import optimize_for_cpu_inference
    from engine.loading import load_model

    if dtype not in _DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = load_model(model, getattr(torch, dtype), dev)
    optimize_for_cpu_inference(loaded.model)
    return loaded


def train_drafter(
    data: Annotated[list[Path], _DATA],
    out: Annotated[Path, typer.Option(help="Artifact directory (also holds the resumable checkpoint)")],
    model: Annotated[str | None, _MODEL] = None,
    dtype: str = "float32",
    device: Annotated[str | None, _DEVICE] = None,
    layers: Annotated[int | None, typer.Option(
        help="Drafter layers (default 1; with --init-from the artifact's, and more appends layers)")] = None,
    taps: Annotated[int | None, typer.Option(help="Tapped target layers (default 5; with --init-from the artifact's)")] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Trained block size (default 16; with --init-from the artifact's)")] = None,
    steps: int = 1000,
    max_minutes: Annotated[float | None, typer.Option(
        help="Wall-clock budget; the LR anneals over it when it ends first")] = None,
    batch_size: int = 4,
    anchors: Annotated[int, typer.Option(help="Blocks per sequence per step")] = 32,
    max_seq_len: int = 1024,
    lr: float = 6e-4,
    warmup_ratio: float = 0.04,
    gamma: Annotated[float, typer.Option(help="Loss decay over block positions: exp(-(k-1)/gamma)")] = 7.0,
    seed: int = 0,
    heldout_fraction: float = 0.05,
    eval_every: int = 50,
    patience: int = 5,
    checkpoint_every: int = 100,
    resume: Annotated[bool, typer.Option(help="Continue from OUT/checkpoint.pt when present")] = True,
    init_from: Annotated[Path | None, typer.Option(help="Warm start from this drafter artifact")] = None,
    trim_vocab: Annotated[bool, typer.Option(
        help="Output only tokens seen in training responses (with --init-from: add them to the artifact's)")] = False,
    distill: Annotated[bool, typer.Option(
        help="Also anchor in prompts; labels are the target's own greedy predictions")] = False,
    mixed_precision: Annotated[bool, typer.Option(help="bf16 autocast for the drafter (fp32 master weights)")] = False,
    feature_cache_gb: Annotated[float, typer.Option(help="Memory for cached target hidden states; 0 = off")] = 4.0,
    feature_dir: Annotated[Path | None, typer.Option(
        help="Also keep the target's hidden states here, so later runs on the same sequences skip the target")] = None,
    feature_dir_gb: Annotated[float | None, typer.Option(
        help="Cap --feature-dir at this size; the least recently used files go first (default: no cap)")] = None,
    eval_tau: Annotated[bool, typer.Option(help="Replay held-out tau at every evaluation (a tau-vs-time curve)")] = False,
    progress: bool = True,
) -> None:
    """Train a DFlash drafter on the target's own outputs and write the artifact to OUT."""
    from engine.dflash_train import Trainer, TrainConfig
    from engine.training_data import read_sequences

    try:
        cfg = TrainConfig(
            out_dir=str(out), num_layers=layers, num_taps=taps, block_size=block_size, max_steps=steps,
            max_seconds=None if max_minutes is None else max_minutes * 60, batch_size=batch_size,
            num_anchors=anchors, max_seq_len=max_seq_len, lr=lr, warmup_ratio=warmup_ratio, gamma=gamma,
            seed=seed, heldout_fraction=heldout_fraction, eval_every=eval_every, patience=patience,
            checkpoint_every=checkpoint_every, resume=resume, init_from=str(init_from) if init_from else None,
            trim_vocab=trim_vocab, distill=distill, mixed_precision=mixed_precision,
            feature_cache_gb=feature_cache_gb, feature_dir=str(feature_dir) if feature_dir else None,
            feature_dir_gb=feature_dir_gb,
            eval_tau=eval_tau, progress=progress,
        )
        sequences = read_sequences(data)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = _target(model, dtype, device)
    try:
        trainer = Trainer(cfg, loaded.model, loaded.fingerprint, sequences)
    except ValueError as e:  # unusable data, a checkpoint of another run, a warm start for another model
        raise typer.BadParameter(str(e)) from e
    result = trainer.run()
    typer.echo(json.dumps({
        "artifact": str(result.artifact), "steps": result.steps, "seconds": round(result.seconds, 1),
        "steps_per_second": result.steps_per_second, "train_response_tokens": result.train_tokens,
        "final_train_loss": result.final_train_loss, "best_heldout_loss": result.best_heldout_loss,
        "stop_reason": result.stop_reason, "features": result.features, "history": result.history,
    }, indent=2))


def eval_drafter(
    data: Annotated[list[Path], _DATA],
    drafter: Annotated[list[Path] | None, typer.Option(help="Drafter artifact directory (repeatable)")] = None,
    ngram: Annotated[bool, typer.Option(help="Include the n-gram lookup baseline")] = True,
    ngram_block_size: Annotated[int | None, typer.Option(help="Default: the first drafter's block size, else 8")] = None,
    combined: Annotated[bool, typer.Option(help="Also replay each drafter combined with n-gram lookup")] = True,
    min_match: Annotated[int, typer.Option(help="Combined: n-gram match length that overrides the drafter")] = 3,
    block_size: Annotated[int | None, typer.Option(help="Serve drafters at this (lower) block size")] = None,
    model: Annotated[str | None, _MODEL] = None,
    dtype: str = "float32",
    device: Annotated[str | None, _DEVICE] = None,
    limit: Annotated[int | None, typer.Option(help="Use only the first N sequences")] = None,
    batch_size: int = 8,
    generate: Annotated[bool, typer.Option(help="Also measure by real speculative generation on the engine")] = False,
    concurrency: Annotated[int, typer.Option(help="--generate: sequences decoded together")] = 8,
    output: Annotated[Path | None, typer.Option(help="Also write the JSON here")] = None,
) -> None:
    """Tau and per-position acceptance on stored target outputs: replayed, and with --generate also
    measured by real speculative generation."""
    from engine.acceptance import compare
    from engine.drafter_artifact import read_meta
    from engine.training_data import read_sequences

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
    loaded = _target(model, dtype, device)
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

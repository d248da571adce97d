"""`specloop generate`: bootstrap drafter training data by letting the target answer a prompt set.

A drafter must predict the target's own outputs, so the target answers every prompt (greedy, with
its chat template) and each (prompt ids, response ids) pair is written as a training sequence.
Generation runs on our engine with continuous batching at high concurrency, which is where the
throughput comes from (transformers' batched `generate` made about 57 tokens/s here).

A deterministic held-out split by prompt hash is written beside the training file, so held-out
prompts never appear in training data. Answers are appended chunk by chunk, so a long run
(hours over the evals corpus) keeps what it finished when stopped, and `--resume` skips the
prompts already answered. `--skip-answered-in` skips prompts an earlier round's data already holds:
sampling evals again with a new seed drew 1,936 prompts of 5,120 that earlier rounds had answered
(its small tasks have few prompts), and greedy answers to them would only repeat those rounds'.
`--weights nvfp4` answers with the NVFP4 target (another base model: `stats.json` records its
fingerprint and the one it was quantized from). This file holds only the command and its wiring.
"""

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from specloop.daemon.training.cli import NVFP4_EMBEDDING_OPTION, NVFP4_LM_HEAD_OPTION, WEIGHTS_OPTION, weight_format
from specloop.daemon.training.prompts import PromptSource
from specloop.engine.loaders.weight_format import WeightKind

log = logging.getLogger(__name__)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)


def generate(
    out: Annotated[Path, typer.Option(help="Directory for train.jsonl, heldout.jsonl and stats.json")],
    source: Annotated[PromptSource, typer.Option(help="Prompt set")] = "humaneval",
    prompts_file: Annotated[Path | None, typer.Option(help='source=file: JSONL of {"messages": [...]}')] = None,
    per_task: Annotated[int, typer.Option(help="evals only: prompts sampled from each of its 660 tasks")] = 20,
    limit: Annotated[int | None, typer.Option(help="Use at most this many prompts")] = None,
    heldout_fraction: Annotated[float, typer.Option(help="Share of prompts kept out of training")] = 0.25,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per prompt")] = 256,
    concurrency: Annotated[int, typer.Option(help="Sequences decoded together (KV-cache slots)")] = 32,
    max_len: Annotated[int, typer.Option(help="Context length; longer prompts are skipped")] = 1536,
    model: Annotated[str | None, typer.Option(help="HF directory or .gguf (default: SmolLM2 GGUF)")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    weights: Annotated[WeightKind, WEIGHTS_OPTION] = "auto",
    nvfp4_lm_head: Annotated[bool, NVFP4_LM_HEAD_OPTION] = False,
    nvfp4_embedding: Annotated[bool, NVFP4_EMBEDDING_OPTION] = False,
    seed: Annotated[int, typer.Option(help="Prompt sampling seed")] = 0,
    chunk: Annotated[int, typer.Option(help="Prompts answered between appends to the output files")] = 512,
    resume: Annotated[bool, typer.Option(help="Keep existing output files and skip prompts already answered")] = False,
    skip_answered_in: Annotated[list[Path] | None, typer.Option(
        help="Training data (JSONL, Parquet file or directory) whose prompts are not answered again")] = None,
) -> None:
    """Answer a prompt set with the target and store the answers as drafter training data."""
    import json

    import torch

    from specloop.daemon.training.prompts import prompt_set
    from specloop.engine.loaders.load import load_for_inference, resolve_device
    from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
    from specloop.engine.runtime.sequence import SamplingParams
    from specloop.storage.sequences import TokenSequence, append_jsonl, digest, read_sequences, split_heldout

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if concurrency < 1 or max_tokens < 1 or chunk < 1:
        raise typer.BadParameter("--concurrency, --max-tokens and --chunk must be >= 1")
    try:
        prompts = prompt_set(source, prompts_file, per_task, seed)
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("prompts_file: "), param_hint="'--prompts-file'") from e
    try:
        answered_before = {s.prompt for s in read_sequences(skip_answered_in or [])}
    except ValueError as e:
        raise typer.BadParameter(f"--skip-answered-in: {e}") from e
    fmt = weight_format(weights, nvfp4_lm_head, nvfp4_embedding)
    try:
        loaded = load_for_inference(model, getattr(torch, dtype), resolve_device(), fmt)
    except ValueError as e:  # a model that is not there, a layer NVFP4 cannot hold
        raise typer.BadParameter(str(e)) from e
    max_len = min(max_len, loaded.model.config.max_position)
    ids = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(list(p.messages))) for p in prompts]
    ids = [p for p in ids if len(p) + max_tokens <= max_len][:limit]
    if not ids:
        raise typer.BadParameter("no prompt fits --max-len with --max-tokens")
    out.mkdir(parents=True, exist_ok=True)
    files = (out / "train.jsonl", out / "heldout.jsonl")
    done = (_answered(files) if resume else set()) | answered_before
    before = len(ids)
    ids = [p for p in ids if tuple(p) not in done]
    skipped = before - len(ids)
    if not resume:
        for f in files:
            f.write_text("")
    engine = LLMEngine(loaded.model, EngineConfig(num_slots=concurrency, max_len=max_len),
                       loaded.tokenizer.eos_token_ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started, tokens, counts = time.perf_counter(), 0, [0, 0]
    for lo in range(0, len(ids), chunk):
        seqs = engine.generate(ids[lo:lo + chunk], params)
        data = [TokenSequence(tuple(s.prompt_ids), tuple(s.output_ids)) for s in seqs]
        for f, part, i in zip(files, split_heldout(data, heldout_fraction), (0, 1)):
            append_jsonl(f, part)
            counts[i] += len(part)
        tokens += sum(len(s.output_ids) for s in seqs)
        seconds = time.perf_counter() - started
        log.info("answered %d/%d prompts, %d tokens, %.1f tokens/s", lo + len(seqs), len(ids), tokens,
                 tokens / seconds)
    seconds = time.perf_counter() - started
    stats = {"source": source, "prompts": sum(counts), "train": counts[0], "heldout": counts[1],
             "skipped_already_answered": skipped, "response_tokens": tokens, "seconds": round(seconds, 1),
             "tokens_per_second": round(tokens / max(seconds, 1e-9), 1), "concurrency": concurrency,
             "dtype": dtype, **loaded.weights.card(),
             "base_model": loaded.fingerprint, "source_base_model": loaded.source_fingerprint,
             "digest": digest(read_sequences(files))}
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    typer.echo(json.dumps(stats))


def _answered(files: tuple[Path, ...]) -> set[tuple[int, ...]]:
    """Prompts already in the output files (a resumed run skips them)."""
    from specloop.storage.sequences import read_sequences

    return {s.prompt for s in read_sequences([f for f in files if f.exists()])}

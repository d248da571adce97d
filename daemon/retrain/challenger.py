"""Training the challenger: the trainer on the run's dataset, warm-started from the champion, in
chunks of steps so that a stop request (SIGTERM) or a lost lease ends it between two steps.

With the policy's `training.processes` > 1 the trainer runs data-parallel instead, as
`torchrun ... -m specloop.daemon.cli train-drafter` in a child process that loads its own copies of the
target; a stop request or a lost lease ends it with SIGTERM, then SIGKILL.

The policy's training section becomes a `TrainConfig`. The output vocabulary is trimmed to the
tokens seen in training answers (new ones are added to a warm start's), and labels are the
target's own greedy predictions (`distill`), as the shipped drafter was trained
(docs/drafter-training.md). The trainer's own held-out split (which weights to keep, early stopping)
comes out of the run's training split, and only where it holds enough traces to choose by
(`early_stopping_fraction`); the run's eval split stays for the gate.

Not here: the trainer (`daemon/training/`), choosing or evaluating (`contest.py`, `gate.py`).
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from specloop.daemon.child_command import SAFE_PATH_ENV
from specloop.daemon.retrain.policy import Training
from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.trainer import Trainer, TrainResult
from specloop.engine.loaders.weight_format import DENSE, WeightFormat
from specloop.engine.model.transformer import Transformer
from specloop.storage.child_process import die_with_parent
from specloop.storage.sequences import TokenSequence, write_jsonl

log = logging.getLogger(__name__)

_CHUNK_STEPS = 10  # a stop request waits at most this many steps (about 10 s on 2 cores)
_PROGRESS_S = 30.0
_POLL_S = 0.5  # how often a run under torchrun looks for a stop request
# On SIGTERM torchrun signals its processes and kills those still running 30 s later; this leaves it time to.
_TORCHRUN_STOP_S = 35.0
_EARLY_STOPPING_FRACTION = 0.05
_MIN_EARLY_STOPPING = 20  # held-out traces, as the policy's default `evaluation.min_heldout` for the gate


class RunStopped(Exception):
    """The run was asked to stop (SIGTERM) or lost its lease; nothing was registered."""


def training_dtype(choice: str) -> str:
    """The target's dtype for training: `auto` is bf16 (with bf16 autocast for the drafter) on a GPU
    or a CPU that computes bf16 natively, fp32 elsewhere: emulated bf16 autocast ran more than 6 s a
    step against 0.9 s in fp32 (Ice Lake, docs/drafter-training.md)."""
    if choice != "auto":
        return choice
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    from specloop.kernels.cpu_features import CpuFeatures, forced_isa, plan

    cpu = plan(CpuFeatures.detect(), forced_isa(), torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return "bfloat16" if cpu.onednn_bf16 else "float32"


def early_stopping_fraction(train_sequences: int) -> float:
    """The share of the run's `train_sequences` training traces that the trainer holds out to pick the
    weights it keeps (those with the lowest held-out loss): none where that share would hold fewer
    than `_MIN_EARLY_STOPPING` traces, and the trainer trains on all of them and keeps its last weights.

    Why: the demo's first run (Zen 3) trained on 77 traces; the 5% split held 1, whose loss kept the
    weights of step 125 of 283. Replayed on the 69 held-out prompts, drafter + n-gram, those gave τ
    3.095, the last weights 3.194, and a run on all 77 with no split (372 steps) 3.186. A challenger
    is judged by the gate's held-out traces either way."""
    held = train_sequences * _EARLY_STOPPING_FRACTION
    return _EARLY_STOPPING_FRACTION if held >= _MIN_EARLY_STOPPING else 0.0


def train_config(training: Training, out_dir: Path, warm_start: Path | None, seed: int, dtype: str,
                 train_sequences: int) -> TrainConfig:
    return TrainConfig(
        out_dir=str(out_dir), init_from=None if warm_start is None else str(warm_start),
        block_size=None if warm_start is not None else training.block_size,
        max_steps=training.max_steps, max_seconds=training.max_minutes * 60, batch_size=training.batch_size,
        num_anchors=training.anchors, lr=training.lr, distill=training.distill, trim_vocab=True,
        skip_suffix_covered=training.skip_suffix_covered,
        mixed_precision=dtype == "bfloat16", heldout_fraction=early_stopping_fraction(train_sequences), seed=seed,
        eval_every=max(10, training.max_steps // 8), checkpoint_every=training.max_steps, resume=False,
        progress=False, feature_cache_gb=2.0)


def train_challenger(cfg: TrainConfig, target: Transformer, base_model: str, sequences: list[TokenSequence],
                     should_stop: Callable[[], str | None], stop: threading.Event, processes: int = 1,
                     model_source: Path | None = None, weights: WeightFormat = DENSE) -> TrainResult:
    """Train and write the artifact to `cfg.out_dir`; RunStopped when `should_stop()` gives a reason. With
    `processes` > 1, under torchrun, each process loading the target from `model_source` as `weights`."""
    if cfg.heldout_fraction == 0:
        log.info("training: on all %d traces, keeping the last weights (too few to hold out %d of their own "
                 "to choose weights by; the gate's held-out traces judge the result)", len(sequences),
                 _MIN_EARLY_STOPPING)
    if processes > 1:
        assert model_source is not None, "the processes under torchrun load the target from its source"
        return _train_under_torchrun(cfg, target, model_source, processes, sequences, should_stop, stop,
                                     weights.cli_options())
    trainer = Trainer(cfg, target, base_model, sequences)
    last_report = time.monotonic()
    reason = None
    while reason is None:
        reason = trainer.advance(trainer.step + _CHUNK_STEPS)
        why = "stop requested" if stop.is_set() else should_stop()
        if why is not None:
            raise RunStopped(f"training stopped at step {trainer.step}: {why}")
        if time.monotonic() - last_report >= _PROGRESS_S or reason is not None:
            last_report = time.monotonic()
            log.info("training: step %d/%d, %.0f/%.0f s, loss %.3f", trainer.step, cfg.max_steps, trainer.elapsed,
                     cfg.max_seconds or 0, trainer.last_loss)
    return trainer.finish(reason)


def _train_under_torchrun(cfg: TrainConfig, target: Transformer, model_source: Path, processes: int,
                          sequences: list[TokenSequence], should_stop: Callable[[], str | None],
                          stop: threading.Event, target_options: list[str]) -> TrainResult:
    """`train-drafter` in `processes` processes under torchrun on `sequences`; its result. The artifact's
    fingerprint is the one they compute from `model_source` (the gate refuses one of another model)."""
    out = Path(cfg.out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix="torchrun-") as scratch:
        data, config, printed = (Path(scratch) / name for name in ("train.jsonl", "config.json", "result.json"))
        write_jsonl(data, sequences)
        cfg.write(config)
        command = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(processes), "-m", "specloop.daemon.cli", "train-drafter", "--config", str(config), "--data",
                   str(data), "--model", str(model_source), "--dtype", str(target.dtype).removeprefix("torch."),
                   "--device", target.device.type, *target_options]
        # stdout to a file, not a pipe: the result's JSON (its history grows with the run) could fill a
        # pipe that is read only at the end. stderr, the processes' logs, goes to the daemon's.
        with printed.open("wb") as stdout:
            child = subprocess.Popen(command, stdout=stdout, start_new_session=True, preexec_fn=die_with_parent(),
                                     env={**os.environ, **SAFE_PATH_ENV})
            log.info("training: %d processes under torchrun (pid %d)", processes, child.pid)
            try:
                _wait(child, should_stop, stop)
            finally:
                _end(child)
        if child.returncode != 0:
            raise RuntimeError(f"train-drafter under torchrun exited with status {child.returncode} (its log is above)")
        result = json.loads(printed.read_text())
    return TrainResult(Path(result["artifact"]), result["steps"], result["seconds"], result["steps_per_second"],
                       result["train_response_tokens"], result["final_train_loss"], result["best_heldout_loss"],
                       result["stop_reason"], result["history"], result["features"])


def _wait(child: subprocess.Popen, should_stop: Callable[[], str | None], stop: threading.Event) -> None:
    """Until `child` exits; RunStopped, with `child` still running, when a stop is asked for."""
    while child.poll() is None:
        why = "stop requested" if stop.wait(_POLL_S) else should_stop()
        if why is not None:
            raise RunStopped(f"training under torchrun stopped: {why}")


def _end(child: subprocess.Popen) -> None:
    """End `child` if it still runs: SIGTERM (torchrun passes it on to its processes), SIGKILL if it outlasts that."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(_TORCHRUN_STOP_S)
    except subprocess.TimeoutExpired:
        log.error("torchrun did not stop within %.0f s of SIGTERM; killing it", _TORCHRUN_STOP_S)
        child.kill()
        child.wait()

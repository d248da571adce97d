"""Training a DFlash drafter: `Trainer` wires the parts of one run together and runs the loop.

Loop: AdamW, linear warmup then cosine decay (over the step or the wall-clock budget, whichever is
further along), gradient clipping, a fixed seed (data order and anchors are functions of the seed
and step, so a resumed run repeats the same batches), step and wall-clock budgets, held-out
evaluation with early stopping (the best weights are what is saved), resumable checkpoints, warm
start from an artifact, optional output-vocabulary trimming.

Each job has its own file in `daemon/training/`:

| job | file |
| --- | --- |
| the run's settings | `config.py` (`TrainConfig`) |
| the starting drafter, fresh or warm-started | `drafter_init.py` |
| the held-out split, epoch order, batches | `data_order.py` |
| the target's taps, cached across steps and runs | `target_features.py` (over `feature_store.py`) |
| the block loss | `objective.py` |
| positions suffix decoding drafts instead (optionally skipped as anchors) | `suffix_covered.py` |
| LR schedule, gradient step | `optimizer_step.py` |
| held-out loss and τ, early stopping | `heldout.py` |
| the resumable state, `checkpoint.pt` | `checkpoint.py` |
| the process group under `torchrun`, its collectives | `distributed.py` |

Under `torchrun` each process trains on its rows of every batch and the gradients are averaged; the
main process (rank 0) alone evaluates, keeps the clock and decides when to stop, and each step
every process takes its word (`advance`), so all of them stop at the same step. Only the main
process writes checkpoints and the artifact. In one process none of this does anything.

Not here: reading data (`storage/sequences.py`), the CLI (`daemon/training/cli.py`), the artifact
format (`engine/speculation/drafter_artifact.py`).
"""

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specloop.daemon.training import distributed
from specloop.daemon.training.checkpoint import Checkpoint
from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.data_order import DataOrder, split_sequences
from specloop.daemon.training.drafter_init import build_drafter
from specloop.daemon.training.heldout import Evaluation
from specloop.daemon.training.objective import BlockLoss
from specloop.daemon.training.optimizer_step import OptimizerStep
from specloop.daemon.training.suffix_covered import suffix_covered
from specloop.daemon.training.target_features import TargetFeatures
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.drafter_artifact import Lineage, read_meta, save_drafter
from specloop.storage.sequences import TokenSequence

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    artifact: Path
    steps: int
    seconds: float
    steps_per_second: float
    train_tokens: int  # response tokens in the training split
    final_train_loss: float
    best_heldout_loss: float | None
    stop_reason: str
    history: list[dict] = field(default_factory=list)
    # Where the target's features came from: computed, or read from --feature-dir; files evicted by its cap.
    features: dict[str, int] = field(default_factory=dict)


class Trainer:
    """One training run: its parts, its progress, and the loop; `run()` trains until a budget or early
    stop and writes the artifact."""

    def __init__(self, cfg: TrainConfig, target: Transformer, fingerprint: str, sequences: list[TokenSequence]) -> None:
        self.train_set, self.heldout, self.data_digest = split_sequences(sequences, cfg)
        self.cfg, self.target, self.fingerprint = cfg, target.eval().requires_grad_(False), fingerprint
        self.device = target.device
        self.drafter = build_drafter(cfg, target, self.train_set).to(self.device).float()
        # The warm start's base model: this target's, or the one it was trained for (`drafter_init.py`).
        self.parent_base_model = read_meta(cfg.init_from)["base_model_fingerprint"] if cfg.init_from else None
        if cfg.max_seq_len <= self.drafter.config.block_size:
            raise ValueError(f"max_seq_len must exceed the block size {self.drafter.config.block_size}, "
                             f"got {cfg.max_seq_len}")
        loss = BlockLoss(cfg, self.drafter, target)
        self.data = DataOrder(self.train_set, cfg, self.device, distributed.rank(), distributed.world_size(),
                              self._suffix_covered())
        self.features = TargetFeatures(cfg, target, fingerprint, self.drafter.config.tap_layers, self.train_set)
        self.optimizer_step = OptimizerStep(cfg, self.drafter, loss)
        self.evaluation = Evaluation(cfg, self.drafter, target, self.heldout, loss)
        self.step, self.elapsed = 0, 0.0
        # Block positions trained on so far: labels, not tokens (a token is a label in every block it
        # falls in); and of those, first drafts, the position every accepted draft depends on.
        self.supervised_seen = self.first_drafts_seen = 0
        self.last_loss, self.steps_per_second = float("nan"), 0.0
        self.out = Path(cfg.out_dir)
        if cfg.resume and Checkpoint.exists(self.out):
            self._resume()

    def _suffix_covered(self) -> list[torch.Tensor] | None:
        """With `skip_suffix_covered`, the positions suffix decoding drafts in the drafter's place."""
        if not self.cfg.skip_suffix_covered:
            return None
        started = time.monotonic()
        covered = suffix_covered(self.train_set, self.cfg.max_seq_len)
        response = sum(len(s.response) for s in self.train_set)
        log.info("training: suffix decoding drafts after %d of %d response positions (found in %.1f s); no block "
                 "is anchored there", sum(int(c.sum()) for c in covered), response, time.monotonic() - started)
        return covered

    def advance(self, until: int) -> str | None:
        """Train up to step `until`; the reason when a budget or early stopping ended training, else None."""
        cfg = self.cfg
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not (cfg.progress and distributed.is_main()),
                   desc="train-drafter")
        t0, start_step = time.monotonic(), self.step
        start = t0 - self.elapsed
        reason = None
        while reason is None and self.step < min(until, cfg.max_steps):
            self.last_loss = self._train_step()
            self.step += 1
            self.elapsed = time.monotonic() - start
            bar.update(1)
            bar.set_postfix(loss=f"{self.last_loss:.3f}", lr=f"{self.optimizer_step.opt.param_groups[0]['lr']:.1e}")
            if self.heldout and self.step % cfg.eval_every == 0 and self._evaluate():
                reason = "early_stop"
            elif cfg.max_seconds is not None and self.elapsed >= cfg.max_seconds:
                reason = "max_seconds"
            # The schedule follows the clock and every process must stop at the same step: all of them
            # take the main process's clock and reason (it alone evaluates).
            self.elapsed, reason = distributed.from_main((self.elapsed, reason))
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        bar.close()
        self.steps_per_second = (self.step - start_step) / max(1e-9, time.monotonic() - t0)
        return reason or ("max_steps" if self.step >= cfg.max_steps else None)

    def run(self) -> TrainResult:
        """Train until `max_steps`, the wall-clock budget or early stopping; write the artifact (best weights)."""
        return self.finish(self.advance(self.cfg.max_steps) or "max_steps")

    def finish(self, reason: str) -> TrainResult:
        """Evaluate once more unless the last step just was, save, and write the artifact (best weights);
        `reason` is why training stopped (a caller that trains in chunks with `advance` ends with this)."""
        history = self.evaluation.history
        if self.heldout and (not history or history[-1]["step"] != self.step):
            self._evaluate()
        self.save_checkpoint()
        log.info("process %d of %d: stopped at step %d (%s)", distributed.rank(), distributed.world_size(),
                 self.step, reason)
        # The main process's result on every process, once its artifact is on disk.
        return distributed.from_main(self._write_artifact(reason) if distributed.is_main() else None)

    def _train_step(self) -> float:
        """One step on this process's rows; the loss averaged over the processes."""
        idx, batch = self.data.batch(self.step)
        stats = self.optimizer_step(self.features.attach(batch, idx), self.step, self.elapsed)
        loss, supervised, first_drafts = distributed.sum_over_ranks(stats.loss.item(), stats.supervised,
                                                                    stats.first_drafts)
        self.supervised_seen += int(supervised)
        self.first_drafts_seen += int(first_drafts)
        return loss / distributed.world_size()

    def _evaluate(self) -> bool:
        """Evaluate on the held-out split now; True when training should stop early. Only the main process
        evaluates (and keeps the best weights): the others' False is replaced by its answer."""
        if not distributed.is_main():
            return False
        seen = {"response_tokens_seen": self.data.response_tokens_seen(self.step),
                "supervised_seen": self.supervised_seen, "first_drafts_seen": self.first_drafts_seen}
        return self.evaluation.evaluate(self.step, self.elapsed, seen)

    def _write_artifact(self, reason: str) -> TrainResult:
        stopping, store = self.evaluation.stopping, self.features.store
        if stopping.best_state is not None:
            self.drafter.load_state_dict(stopping.best_state)
        train_tokens = sum(len(s.response) for s in self.train_set)
        lineage = Lineage(self.data_digest, self.step, self.cfg.seed, {
            "train_sequences": len(self.train_set), "heldout_sequences": len(self.heldout),
            "train_response_tokens": train_tokens, "best_heldout_loss": stopping.best_loss,
            "warm_start": self.cfg.init_from, "warm_start_base_model": self.parent_base_model,
            "seconds": round(self.elapsed, 1), "stop_reason": reason,
        })
        path = save_drafter(self.out, self.drafter, self.fingerprint, lineage)
        log.info("process %d of %d: wrote the drafter artifact %s", distributed.rank(), distributed.world_size(), path)
        features = {"computed": store.misses, "read_from_disk": store.disk_hits, "evicted_from_disk": store.evicted}
        return TrainResult(path, self.step, self.elapsed, self.steps_per_second, train_tokens, self.last_loss,
                           stopping.best_loss, reason, self.evaluation.history, features)

    def save_checkpoint(self) -> None:
        """Write the checkpoint from the main process; every process holds the same weights and AdamW state."""
        if not distributed.is_main():
            return
        stopping = self.evaluation.stopping
        Checkpoint(
            drafter=self.drafter.state_dict(), opt=self.optimizer_step.opt.state_dict(), step=self.step,
            elapsed=self.elapsed, best_loss=stopping.best_loss, best_state=stopping.best_state,
            bad_evals=stopping.bad_evals, history=self.evaluation.history, data_digest=self.data_digest,
            supervised_seen=self.supervised_seen, first_drafts_seen=self.first_drafts_seen,
            config=asdict(self.drafter.config),
        ).save(self.out)

    def _resume(self) -> None:
        saved = Checkpoint.load(self.out, self.device, self.data_digest, asdict(self.drafter.config))
        self.drafter.load_state_dict(saved.drafter)
        self.optimizer_step.opt.load_state_dict(saved.opt)
        self.step, self.elapsed = saved.step, saved.elapsed
        self.supervised_seen, self.first_drafts_seen = saved.supervised_seen, saved.first_drafts_seen
        stopping = self.evaluation.stopping
        stopping.best_loss, stopping.best_state, stopping.bad_evals = saved.best_loss, saved.best_state, saved.bad_evals
        self.evaluation.history = saved.history

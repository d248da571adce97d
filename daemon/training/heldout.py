"""Held-out evaluation during training: loss and draft accuracy, τ by replay when asked, early stopping.

The trainer calls `Evaluation.evaluate` every `eval_every` steps (and once at the end). Each call
appends a point to `history` (the loss-, and with `eval_tau` the τ-, vs-time curve) and says
whether to stop: after `patience` evaluations without a better held-out loss. The weights with the
best held-out loss so far are kept (`EarlyStopping.best_state`); they are what the artifact gets.

Not here: the held-out split (`data_order.split_sequences`), the replay itself
(`daemon/evaluation/replay.py`), saving this state across restarts (`checkpoint.py`).
"""

import copy
import logging

import torch

from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.objective import Batch, BlockLoss
from specloop.daemon.training.target_features import with_target_features
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.dflash import DFlashDrafter
from specloop.storage.sequences import TokenSequence

log = logging.getLogger(__name__)


class EarlyStopping:
    """The best held-out loss so far, the weights that had it, and the evaluations since."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.best_loss: float | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.bad_evals = 0

    def should_stop(self, loss: float, drafter: DFlashDrafter) -> bool:
        """Record the held-out `loss` of `drafter`'s weights; True after `patience` evaluations in a row
        without a better one."""
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.bad_evals = loss, 0
            self.best_state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
            return False
        self.bad_evals += 1
        return self.bad_evals >= self.patience


class Evaluation:
    """The drafter measured on the held-out split; `history` holds one point per evaluation."""

    def __init__(self, cfg: TrainConfig, drafter: DFlashDrafter, target: Transformer, heldout: list[TokenSequence],
                 loss: BlockLoss) -> None:
        self.cfg, self.drafter, self.target, self.heldout, self.loss = cfg, drafter, target, heldout, loss
        self.stopping = EarlyStopping(cfg.patience)
        self.history: list[dict] = []
        self._batches: list[Batch] | None = None

    def evaluate(self, step: int, elapsed: float, seen: dict[str, int]) -> bool:
        """Record held-out loss (and τ) at `step`, next to the counts in `seen`; True when training should
        stop early."""
        loss, acc = self.heldout_loss()
        point = {"step": step, "seconds": round(elapsed, 1), "heldout_loss": loss, "heldout_accuracy": acc, **seen}
        if self.cfg.eval_tau:
            point["heldout_tau"] = self.heldout_tau()
        self.history.append(point)
        # A run in the background (no progress bar) is otherwise silent until it ends.
        log.info("step %d (%.1f min): held-out loss %.3f, accuracy %.1f%%%s", step, elapsed / 60, loss,
                 100 * acc, f", tau {point['heldout_tau']:.3f}" if "heldout_tau" in point else "")
        return self.stopping.should_stop(loss, self.drafter)

    @torch.no_grad()
    def heldout_loss(self) -> tuple[float, float]:
        """Mean weighted loss and draft accuracy on the held-out split, with fixed anchors."""
        self.drafter.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed)
        losses, correct, total = [], 0, 0
        for batch in self._heldout_batches():
            s = self.loss(batch, gen)
            losses.append(float(s.loss))
            correct, total = correct + s.correct, total + s.supervised
        return sum(losses) / len(losses), correct / max(1, total)

    def heldout_tau(self) -> float:
        """τ of greedy speculative decoding replayed over the held-out split with the current weights."""
        from specloop.daemon.evaluation.replay import replay
        from specloop.engine.speculation.dflash_proposer import DFlashProposer

        # The proposer casts its drafter to the target's dtype in place: give it a copy.
        proposer = DFlashProposer(copy.deepcopy(self.drafter), self.target)
        return replay(proposer, self.heldout, self.target, batch_size=self.cfg.batch_size).tau

    def _heldout_batches(self) -> list[Batch]:
        """The held-out split in batches with the target's features attached, computed once: the
        target pass took 6 of the 12 s of each evaluation of 10 SmolLM2 sequences here."""
        if self._batches is None:
            cfg, taps = self.cfg, self.drafter.config.tap_layers
            self._batches = []
            for i in range(0, len(self.heldout), cfg.batch_size):
                batch = Batch.of(self.heldout[i:i + cfg.batch_size], cfg.max_seq_len, self.target.device)
                self._batches.append(with_target_features(batch, self.target, taps, cfg.distill))
        return self._batches

"""One optimiser step on the drafter: the LR schedule, the block loss, gradient clipping and AdamW.

The step's anchors come from a generator seeded by the run's seed and the step number, so a resumed
run draws the same anchors. Mixed precision is the loss's bf16 autocast only: the drafter's weights
and AdamW's state stay fp32. In a run of several processes, each computes the loss of its rows of the
batch and the gradients are averaged over the processes before clipping, so every process takes the
same step (`daemon/training/distributed.py`).

Not here: the loss itself (`daemon/training/objective.py`), which batch a step trains on
(`data_order.py`), the loop and its budgets (`trainer.py`).
"""

import math

import torch

from specloop.daemon.training import distributed
from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.objective import Batch, BlockLoss, StepStats
from specloop.engine.speculation.dflash import DFlashDrafter


def lr_factor(step: int, total: int, warmup_ratio: float, time_fraction: float = 0.0) -> float:
    """Linear warmup over the first steps, then cosine decay to 0 over whichever budget is further
    along: `step` of `total`, or `time_fraction` of the wall-clock budget.

    Following the clock matters when time binds: a 78-minute run with a 2,400-step schedule stopped
    at step 1,801 with the LR still at 13% of its peak, never annealed. The price is that a run
    bounded by time is not bit-reproducible (its LR depends on how fast the steps ran); one bounded
    by steps still is.
    """
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_fraction)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class OptimizerStep:
    """AdamW over the drafter's parameters, stepped on `loss` at the schedule's LR."""

    def __init__(self, cfg: TrainConfig, drafter: DFlashDrafter, loss: BlockLoss) -> None:
        self.cfg, self.drafter, self.loss = cfg, drafter, loss
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_factor(self, step: int, elapsed: float) -> float:
        """The schedule's factor at `step` after `elapsed` seconds of training."""
        cfg = self.cfg
        time_fraction = elapsed / cfg.max_seconds if cfg.max_seconds is not None else 0.0
        return lr_factor(step, cfg.max_steps, cfg.warmup_ratio, time_fraction)

    def __call__(self, batch: Batch, step: int, elapsed: float) -> StepStats:
        """Train on `batch` as step `step`, `elapsed` seconds into the run."""
        self.drafter.train()
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * self.lr_factor(step, elapsed)
        stats = self.loss(batch, gen)
        self.opt.zero_grad(set_to_none=True)
        stats.loss.backward()
        # Averaged by hand, not by wrapping the drafter in DistributedDataParallel: the loss calls the
        # drafter's fuse, context_kv and run_blocks, never its forward, and DDP syncs only the gradients
        # of a backward that follows its own forward. The mean is over processes, not over supervised
        # positions: a process with fewer labels this step weighs as much as one with more.
        distributed.average_gradients(self.drafter.parameters())
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return stats

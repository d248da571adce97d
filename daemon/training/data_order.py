"""Which sequences a run trains on, and which of them each step's batch holds.

`split_sequences` keeps the usable sequences and splits off the held-out set for early stopping.
`DataOrder` shuffles the training sequences per epoch, groups them into batches of similar
length, and gives step n its batch. Both are functions of the seed, the epoch and the step only,
so a resumed run repeats the same batches. A run in several processes (`distributed.py`) splits
each step's batch between them: the batch size stays the run's, and so do its epochs.

Not here: reading data (`storage/sequences.py`), the target's features of a batch
(`target_features.py`), anchors inside a batch (`objective.py`).
"""

import torch

from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.objective import Batch
from specloop.storage.sequences import TokenSequence, digest, split_heldout


def split_sequences(sequences: list[TokenSequence],
                    cfg: TrainConfig) -> tuple[list[TokenSequence], list[TokenSequence], str]:
    """(training split, held-out split, digest of both) of the sequences that have a response of >= 2
    tokens and a prompt that leaves room for it within `max_seq_len`."""
    usable = [s for s in sequences if len(s.response) >= 2 and len(s.prompt) < cfg.max_seq_len - 1]
    if not usable:
        raise ValueError("training data has no sequence with a response of >= 2 tokens within max_seq_len")
    train, heldout = split_heldout(usable, cfg.heldout_fraction, salt="early-stopping")
    if not train:
        raise ValueError("held-out split left no training sequences; lower heldout_fraction")
    return train, heldout, digest(usable)


class DataOrder:
    """The training sequences of every step, epoch after epoch."""

    def __init__(self, train_set: list[TokenSequence], cfg: TrainConfig, device: torch.device, rank: int = 0,
                 world_size: int = 1, skipped: list[torch.Tensor] | None = None) -> None:
        if cfg.batch_size < world_size:
            raise ValueError(f"batch_size {cfg.batch_size} is less than the {world_size} processes: "
                             "each needs a row of every batch")
        self.train_set, self.device, self.rank, self.world_size = train_set, device, rank, world_size
        self.batch_size, self.seed, self.max_seq_len = cfg.batch_size, cfg.seed, cfg.max_seq_len
        self.skipped = skipped  # per training sequence, the positions to anchor no block at
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its sequence order)

    def batch(self, step: int) -> tuple[list[int], Batch]:
        """This process's rows of step `step`'s batch: their training indices and their batch (no target
        features yet). Rows are dealt out in turn: a batch holds sequences of similar length, so the shares
        of the processes cost about the same."""
        n, bs = len(self.train_set), self.batch_size
        idx = [self.epoch_order(i // n)[i % n] for i in range(step * bs, step * bs + bs)][self.rank::self.world_size]
        skipped = None if self.skipped is None else [self.skipped[i] for i in idx]
        return idx, Batch.of([self.train_set[i] for i in idx], self.max_seq_len, self.device, skipped)

    def response_tokens_seen(self, steps: int) -> int:
        """Response tokens in the batches of the first `steps` steps (epochs counted again)."""
        n, bs = len(self.train_set), self.batch_size
        per_epoch = sum(len(s.response) for s in self.train_set)
        epochs, rest = divmod(steps * bs, n)
        if not rest:
            return epochs * per_epoch
        return epochs * per_epoch + sum(len(self.train_set[i].response) for i in self.epoch_order(epochs)[:rest])

    def epoch_order(self, epoch: int) -> list[int]:
        """The training sequences' order in `epoch`: a function of the seed and the epoch only, so a
        resumed run repeats the same batches. The last epoch's order is kept, not redrawn per item."""
        if self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(len(self.train_set), generator=gen).tolist()
            self._order = (epoch, self._length_grouped(order, gen))
        return self._order[1]

    def _length_grouped(self, order: list[int], gen: torch.Generator) -> list[int]:
        """`order` regrouped so each batch holds sequences of similar length, batches in random order.

        A batch is padded to its longest sequence and a step costs about anchors × length per row.
        On the evals answers (median 253 tokens, 99th percentile 1,037) random batches of 4 with
        every position an anchor ran at 4.5 s per step in the first epoch, target pass included;
        grouped, with at most 256 anchors per sequence, at 2.3 s.
        """
        bs = self.batch_size
        span = bs * 16  # sort within windows of 16 batches: lengths even out, order stays random
        length = [len(s.prompt) + len(s.response) for s in self.train_set]
        by_len = [i for c in range(0, len(order), span) for i in sorted(order[c:c + span], key=length.__getitem__)]
        full = len(by_len) // bs
        batches = [by_len[b * bs:(b + 1) * bs] for b in torch.randperm(full, generator=gen).tolist()]
        return [i for batch in batches for i in batch] + by_len[full * bs:]  # a short last batch stays last

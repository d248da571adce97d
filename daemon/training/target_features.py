"""The frozen target's features for training: its tapped layer outputs and, when distilling, its greedy picks.

`target_features` runs the target once over a token batch (no grad). `TargetFeatures` attaches the
features to training batches, computing each training sequence's once and keeping it in a
`FeatureStore` (in memory and, with `feature_dir`, on disk for later runs); held-out batches are
attached directly with `with_target_features`.

Not here: the store's memory budget, files and eviction (`daemon/training/feature_store.py`), what
the drafter does with the features (`daemon/training/objective.py`).
"""

from dataclasses import replace

import torch
import torch.nn.functional as F

from specloop.daemon.training.config import TrainConfig
from specloop.daemon.training.feature_store import Features, FeatureStore
from specloop.daemon.training.objective import Batch
from specloop.engine.model.transformer import Transformer
from specloop.storage.sequences import TokenSequence


@torch.no_grad()
def target_features(target: Transformer, tokens: torch.Tensor, tap_layers: tuple[int, ...],
                    greedy: bool) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The target's tapped layer outputs (each `[B, S, H]`) for `tokens` `[B, S]` and, with `greedy`,
    its argmax prediction after each position `[B, S]`."""
    hidden, taps = target(tokens, taps=tap_layers)
    return taps, target.logits(hidden).argmax(dim=-1) if greedy else None


def with_target_features(batch: Batch, target: Transformer, tap_layers: tuple[int, ...], greedy: bool) -> Batch:
    """`batch` with the target's taps (and, with `greedy`, its greedy picks) attached."""
    taps, greedy_next = target_features(target, batch.tokens, tap_layers, greedy)
    return replace(batch, taps=taps, greedy_next=greedy_next)


def feature_namespace(fingerprint: str, target: Transformer, tap_layers: tuple[int, ...], greedy: bool) -> str:
    """What the target's features depend on besides the tokens (`FeatureStore` keys)."""
    taps = ",".join(map(str, tap_layers))
    return f"{fingerprint}|{target.dtype}|taps={taps}|greedy={greedy}"


class TargetFeatures:
    """Target features of training sequences by index into `train_set`, cached in `store`."""

    def __init__(self, cfg: TrainConfig, target: Transformer, fingerprint: str, tap_layers: tuple[int, ...],
                 train_set: list[TokenSequence]) -> None:
        self.target, self.tap_layers, self.train_set = target, tap_layers, train_set
        self.greedy, self.max_seq_len = cfg.distill, cfg.max_seq_len
        disk_bytes = None if cfg.feature_dir_gb is None else cfg.feature_dir_gb * 2**30
        self.store = FeatureStore(feature_namespace(fingerprint, target, tap_layers, cfg.distill),
                                  cfg.feature_cache_gb * 2**30, cfg.feature_dir, target.device, disk_bytes)
        self._keys: dict[int, str] = {}  # training index -> store key, hashed once per run

    def attach(self, batch: Batch, idx: list[int]) -> Batch:
        """`batch` (training sequences `idx`) with the target's taps, and greedy picks when distilling:
        from the store, filling it first while it has room; without room, from one pass over the batch.

        The target pass dominates a step (SmolLM2 on 2 busy CPU cores, batch 4, 32 anchors, 1 drafter
        layer: 29 s per step with it, 5.5 s without), and small datasets are seen for many epochs,
        so each sequence's taps are computed once.
        """
        rows = []
        for i in idx:
            features = self._features(i)
            if features is None:
                return with_target_features(batch, self.target, self.tap_layers, self.greedy)
            rows.append(features)
        S = batch.tokens.shape[1]
        stacked = []
        for column in zip(*rows, strict=True):
            # Right-pad the first dimension to S: taps are [len, H], greedy picks [len].
            stacked.append(torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, S - r.shape[0])) for r in column]))
        if self.greedy:
            return replace(batch, taps=stacked[:-1], greedy_next=stacked[-1])
        return replace(batch, taps=stacked)

    def _features(self, i: int) -> Features | None:
        """Training sequence `i`'s features from the store, computed and stored first if it has room."""
        key = self._key(i)
        features = self.store.get(key)
        if features is None and self.store.can_store():
            tokens = Batch.of([self.train_set[i]], self.max_seq_len, self.target.device).tokens  # [1, S_i]
            # One sequence per target pass: a padded batch of random lengths wasted 45% of its
            # positions on padding here (8 sequences of ~270 tokens padded to 388).
            taps, greedy = target_features(self.target, tokens, self.tap_layers, self.greedy)
            features = [t[0] for t in taps] + ([] if greedy is None else [greedy[0]])  # each [len, …]
            self.store.put(key, features)
        return features

    def _key(self, i: int) -> str:
        """The store key of training sequence `i` (as truncated for training), from its host-side tokens:
        hashing a device tensor would sync the device for every sequence of every step."""
        if i not in self._keys:
            self._keys[i] = self.store.key(self.train_set[i].tokens[:self.max_seq_len])
        return self._keys[i]

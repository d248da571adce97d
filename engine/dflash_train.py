"""Training a DFlash drafter: the block objective and the loop around it.

Objective (one step, per the DFlash paper): run the frozen target over whole sequences (no grad)
to get the tapped hidden states; sample random anchor positions inside each response; each anchor
p starts a block `[token p, mask × (B−1)]` that sees the context features at positions `< p` and its
own block (`engine.dflash.block_mask`, attended as `SeparateBlocks`); block position k (1 ≤ k < B) is trained with
cross-entropy to predict token p + k, weighted by exp(−(k−1)/γ): a draft only counts when every
draft before it was accepted, so early positions matter most.

Distillation (`distill`): anchors may also lie in the prompt, and labels are the target's own
greedy predictions from the same pass (the argmax after position p + k − 1) rather than the stored
tokens. Position k is supervised only while the stored tokens p+1 .. p+k−1 agree with those
predictions, i.e. while the sequence is still the path greedy decoding would have taken; on the
target's own greedy responses this changes nothing, and every prompt position adds an exact
first-draft label for the price of the pass that computes the taps anyway.

Loop: AdamW, linear warmup then cosine decay (over the step or the wall-clock budget, whichever is
further along), gradient clipping, a fixed seed (data order and anchors are functions of the seed
and step, so a resumed run repeats the same batches), step and wall-clock budgets, held-out
evaluation with early stopping (the best weights are what is saved), resumable checkpoints, warm
start from an artifact, optional output-vocabulary trimming.

Not here: reading data (`engine/training_data.py`), the CLI (`engine/drafter_cli.py`), the artifact
format (`engine/drafter_artifact.py`).
"""

import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.dflash import DFlashConfig, DFlashDrafter, SeparateBlocks, context_mask
from engine.drafter_artifact import Lineage, load_drafter, save_drafter
from engine.feature_store import FeatureStore
from engine.model import Transformer
from engine.training_data import TokenSequence, digest, split_heldout

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    out_dir: str
    # Drafter shape; None: 1 layer, 5 taps, block 16 for a new drafter, the warm start's own otherwise.
    num_layers: int | None = None
    num_taps: int | None = None
    block_size: int | None = None
    max_steps: int = 1000
    max_seconds: float | None = None
    batch_size: int = 4
    num_anchors: int = 32  # blocks per sequence per step
    max_seq_len: int = 1024
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float = 7.0  # the paper's decay for B = 16
    seed: int = 0
    heldout_fraction: float = 0.05
    eval_every: int = 50
    patience: int = 5  # evaluations without a better held-out loss before stopping
    feature_cache_gb: float = 4.0  # keep target taps of training sequences in memory, up to this size
    feature_dir: str | None = None  # also keep them here, for later runs (`engine.feature_store`)
    feature_dir_gb: float | None = None  # cap on feature_dir; least recently used files go first
    checkpoint_every: int = 100
    resume: bool = True
    init_from: str | None = None
    trim_vocab: bool = False
    distill: bool = False  # anchors in prompts too, labels from the target's greedy predictions
    mixed_precision: bool = False  # bf16 autocast for the drafter (fp32 master weights)
    eval_tau: bool = False  # also replay speculative decoding on the held-out split at each evaluation
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_taps", "max_steps", "batch_size", "num_anchors", "eval_every",
                     "patience", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.lr <= 0 or self.gamma <= 0 or self.grad_clip <= 0:
            raise ValueError(f"lr, gamma and grad_clip must be > 0, got {self.lr}, {self.gamma}, {self.grad_clip}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.feature_cache_gb < 0:
            raise ValueError(f"feature_cache_gb must be >= 0, got {self.feature_cache_gb}")
        if self.feature_dir_gb is not None and (self.feature_dir is None or self.feature_dir_gb <= 0):
            raise ValueError(f"feature_dir_gb needs a feature_dir and must be > 0, got {self.feature_dir_gb}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, S] long, right-padded with 0
    prompt_lens: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [B] long
    taps: list[torch.Tensor] | None = None  # target layer outputs, each [B, S, H], when already computed
    greedy_next: torch.Tensor | None = None  # [B, S] long: the target's argmax after each position (distill)

    @classmethod
    def of(cls, seqs: list[TokenSequence], max_len: int, device: torch.device) -> "Batch":
        rows = [s.tokens[:max_len] for s in seqs]
        S = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), S, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        prompt_lens = torch.tensor([min(len(s.prompt), max_len) for s in seqs])
        lengths = torch.tensor([len(r) for r in rows])
        return cls(tokens.to(device), prompt_lens.to(device), lengths.to(device))


def sample_anchors(batch: Batch, num_anchors: int, gen: torch.Generator,
                   in_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors `[B, N]` (ascending) and keep `[B, N]` bool: N random distinct response positions per row
    (any position after the first with `in_prompt`) that have at least one token after them; rows
    with fewer valid positions keep only those."""
    B, S = batch.tokens.shape
    pos = torch.arange(S, device=batch.tokens.device)
    first = torch.ones_like(batch.prompt_lens) if in_prompt else batch.prompt_lens
    valid = (pos >= first.view(-1, 1)) & (pos < batch.lengths.view(-1, 1) - 1)  # [B, S]
    counts = valid.sum(dim=1)
    N = max(1, min(num_anchors, int(counts.max())))
    noise = torch.rand(B, S, generator=gen).to(valid.device)
    order = torch.where(valid, noise, 2.0).argsort(dim=1)[:, :N]  # valid positions first, random order
    keep = torch.arange(N, device=valid.device).view(1, -1) < counts.view(-1, 1)  # a prefix of each row
    # Dropped picks sort after every kept one, so `keep` stays a prefix after sorting.
    anchors = torch.where(keep, order, S).sort(dim=1).values
    anchors = torch.where(keep, anchors, 0)
    return anchors, keep


@dataclass
class StepStats:
    loss: torch.Tensor
    correct: int  # argmax hits over supervised positions
    supervised: int
    first_drafts: int  # supervised positions that are a block's first draft (k = 1)


def position_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """`[bs]`: 0 for the anchor, exp(−(k−1)/γ) for block position k ≥ 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


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


def block_labels(batch: Batch, label_pos: torch.Tensor, distill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[B, N, bs]` for block positions `label_pos` (anchor p + k) and whether each may be
    supervised (inside the sequence; with `distill`, also on the target's greedy path)."""
    B, S = batch.tokens.shape
    inside = label_pos < batch.lengths.view(-1, 1, 1)
    stored = batch.tokens.gather(1, label_pos.view(B, -1).clamp(max=S - 1)).view(label_pos.shape)
    if not distill:
        return stored, inside
    assert batch.greedy_next is not None, "distillation needs the target's greedy predictions"
    # Anchors are >= 1, so the low clamp only touches k = 0; the high one, positions past the end.
    prev = (label_pos - 1).clamp(0, S - 1).view(B, -1)
    greedy = batch.greedy_next.gather(1, prev).view(label_pos.shape)  # the target's token for p + k
    # Position k is on the greedy path when stored tokens p+1 .. p+k−1 all equal the target's picks.
    agree = (stored == greedy).long()
    agree[..., 0] = 1
    on_path = torch.cat([torch.ones_like(agree[..., :1]), agree.cumprod(dim=-1)[..., :-1]], dim=-1).bool()
    return greedy, inside & on_path


def dflash_loss(drafter: DFlashDrafter, target: Transformer, batch: Batch, num_anchors: int, gamma: float,
                gen: torch.Generator, label_map: torch.Tensor | None = None, distill: bool = False,
                mixed_precision: bool = False) -> StepStats:
    """The weighted block cross-entropy of one batch. `label_map` `[V]` maps token ids to trimmed-vocab
    indices (−100 for tokens outside it, which are not supervised)."""
    c = drafter.config
    bs, (B, S) = c.block_size, batch.tokens.shape
    if batch.taps is None or (distill and batch.greedy_next is None):
        batch = with_target_features(batch, target, c.tap_layers, distill)
    with torch.autocast(batch.tokens.device.type, dtype=torch.bfloat16, enabled=mixed_precision):
        fused = drafter.fuse(batch.taps)  # [B, S, H]
        ctx = drafter.context_kv(fused, torch.arange(S, device=fused.device).expand(B, S))
        anchors, keep = sample_anchors(batch, num_anchors, gen, in_prompt=distill)  # [B, N]
        N = anchors.shape[1]
        x = drafter.embed_block(batch.tokens.gather(1, anchors), bs, target.embed)  # [B, N·bs, H]
        offsets = torch.arange(bs, device=anchors.device)
        label_pos = anchors.unsqueeze(-1) + offsets  # [B, N, bs]
        positions = label_pos.view(B, N * bs).clamp(max=c.max_position - 1)
        blocks = SeparateBlocks(context_mask(anchors, keep, S, bs), bs)
        hidden = drafter.run_blocks(x, positions, ctx, blocks)  # [B, N·bs, H]
    labels, usable = block_labels(batch, label_pos, distill)
    if label_map is not None:
        labels = label_map[labels]
    supervised = keep.unsqueeze(-1) & (offsets > 0) & usable & (labels >= 0)
    weights = position_weights(bs, gamma, anchors.device).expand(B, N, bs)[supervised]
    head = drafter.head_weight(target.lm_head).to(hidden.dtype)  # [V', H]
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=mixed_precision):
        logits = (hidden.view(B, N, bs, -1)[supervised] @ head.T).float()  # [M, V']
    targets = labels[supervised]
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    correct = int((logits.argmax(-1) == targets).sum())
    return StepStats(loss, correct, int(targets.numel()), int(supervised[..., 1].sum()))


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


def build_drafter(cfg: TrainConfig, target: Transformer, fingerprint: str, train: list[TokenSequence]) -> DFlashDrafter:
    """A fresh drafter for `target`, or the warm-start artifact's drafter (its trimmed vocabulary
    widened to the new responses' tokens when `trim_vocab`, reshaped by `reconfigure`)."""
    vocab = sorted({t for s in train for t in s.response}) if cfg.trim_vocab else None
    if cfg.init_from:
        drafter = load_drafter(cfg.init_from, fingerprint).drafter
        drafter = widen_vocab(drafter, vocab) if vocab is not None and drafter.trimmed else drafter
        return reconfigure(drafter, cfg)
    shape = {"num_layers": cfg.num_layers, "num_taps": cfg.num_taps, "block_size": cfg.block_size}
    dcfg = DFlashConfig.for_target(target.config, **{k: v for k, v in shape.items() if v is not None})
    if vocab is not None:
        dcfg = DFlashConfig(**{**asdict(dcfg), "output_vocab_size": len(vocab)})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(dcfg)
    with torch.no_grad():
        if vocab is not None:
            drafter.vocab_ids.copy_(torch.tensor(vocab))
        # The average token embedding: a neutral starting point for "some token goes here".
        drafter.mask_embedding.copy_(target.embed.weight.float().mean(dim=0))
    return drafter


def widen_vocab(drafter: DFlashDrafter, tokens: list[int]) -> DFlashDrafter:
    """`drafter` with `tokens` added to its trimmed output vocabulary.

    Retraining on new traffic meets tokens the first data never had; a drafter cannot propose a
    token outside its vocabulary, and prompt labels there are ignored. The output rows are the
    target's own LM head, so widening adds no parameters: every learned weight carries over.
    """
    assert drafter.trimmed
    vocab = sorted(set(drafter.vocab_ids.tolist()) | set(tokens))
    if len(vocab) == drafter.vocab_ids.numel():
        return drafter
    wide = DFlashDrafter(DFlashConfig(**{**asdict(drafter.config), "output_vocab_size": len(vocab)}))
    state = {k: v for k, v in drafter.state_dict().items() if k != "vocab_ids"}
    wide.load_state_dict({**state, "vocab_ids": torch.tensor(vocab)}, strict=True)
    return wide.to(dtype=next(drafter.parameters()).dtype)


def reconfigure(drafter: DFlashDrafter, cfg: TrainConfig) -> DFlashDrafter:
    """The warm-start `drafter` with the depth and block size `cfg` asks for; every learned weight
    carries over and its outputs are unchanged.

    Appended layers start with zero output projections (attention `o`, MLP `down`), so they add
    nothing to the residual stream until training moves those off zero (the README's fifth round
    measures what a second layer bought). No weight depends on the block size, so it may change;
    the tapped layers may not (the fusion layer is sized for them), nor may a drafter lose layers.
    """
    c = drafter.config
    if cfg.num_taps is not None and cfg.num_taps != len(c.tap_layers):
        raise ValueError(f"num_taps {cfg.num_taps} differs from the warm-start drafter's {len(c.tap_layers)} "
                         "(its fusion layer is sized for them)")
    if cfg.num_layers is not None and cfg.num_layers < c.num_layers:
        raise ValueError(f"num_layers {cfg.num_layers} is fewer than the warm-start drafter's {c.num_layers}; "
                         "a drafter cannot be made shallower")
    changes = {k: v for k, v in (("num_layers", cfg.num_layers), ("block_size", cfg.block_size))
               if v is not None and v != getattr(c, k)}
    if not changes:
        return drafter
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        new = DFlashDrafter(DFlashConfig(**{**asdict(c), **changes}))
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    added = tuple(f"layers.{i}." for i in range(c.num_layers, new.config.num_layers))
    assert not unexpected and all(k.startswith(added) for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in new.layers[c.num_layers:]:
            layer.o.weight.zero_()
            layer.mlp.down.weight.zero_()
    return new.to(dtype=next(drafter.parameters()).dtype)


def _label_map(drafter: DFlashDrafter, device: torch.device) -> torch.Tensor | None:
    if not drafter.trimmed:
        return None
    m = torch.full((drafter.config.vocab_size,), -100, dtype=torch.long, device=device)
    m[drafter.vocab_ids] = torch.arange(drafter.vocab_ids.numel(), device=device)
    return m


class Trainer:
    """Owns one training run's state; `run()` trains until a budget or early stop and writes the artifact."""

    def __init__(self, cfg: TrainConfig, target: Transformer, fingerprint: str, sequences: list[TokenSequence]) -> None:
        usable = [s for s in sequences if len(s.response) >= 2 and len(s.prompt) < cfg.max_seq_len - 1]
        if not usable:
            raise ValueError("training data has no sequence with a response of >= 2 tokens within max_seq_len")
        self.cfg, self.target, self.fingerprint = cfg, target.eval().requires_grad_(False), fingerprint
        self.train_set, self.heldout = split_heldout(usable, cfg.heldout_fraction, salt="early-stopping")
        if not self.train_set:
            raise ValueError("held-out split left no training sequences; lower heldout_fraction")
        self.data_digest = digest(usable)
        self.device = target.device
        self.drafter = build_drafter(cfg, target, fingerprint, self.train_set).to(self.device).float()
        if cfg.max_seq_len <= self.drafter.config.block_size:
            raise ValueError(f"max_seq_len must exceed the block size {self.drafter.config.block_size}, got {cfg.max_seq_len}")
        self.label_map = _label_map(self.drafter, self.device)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step, self.elapsed, self.bad_evals = 0, 0.0, 0
        # Block positions trained on so far: labels, not tokens (a token is a label in every block it
        # falls in); and of those, first drafts, the position every accepted draft depends on.
        self.supervised_seen = self.first_drafts_seen = 0
        self.last_loss, self.steps_per_second = float("nan"), 0.0
        self.best_loss: float | None = None
        self.best_state: dict[str, torch.Tensor] | None = None
        self.history: list[dict] = []
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its sequence order)
        self.store = FeatureStore(self._feature_namespace(), cfg.feature_cache_gb * 2**30, cfg.feature_dir, self.device,
                                  None if cfg.feature_dir_gb is None else cfg.feature_dir_gb * 2**30)
        self._feature_keys: dict[int, str] = {}  # training index -> store key, hashed once per run
        self.heldout_batches: list[Batch] | None = None
        self.out = Path(cfg.out_dir)
        if cfg.resume and (self.out / CHECKPOINT).is_file():
            self._load_checkpoint()

    def _batch(self, step: int) -> Batch:
        n, bs = len(self.train_set), self.cfg.batch_size
        idx = [self._epoch_order(i // n)[i % n] for i in range(step * bs, step * bs + bs)]
        batch = Batch.of([self.train_set[i] for i in idx], self.cfg.max_seq_len, self.device)
        return self._with_cached_taps(batch, idx)

    def _feature_namespace(self) -> str:
        """What the target's features depend on besides the tokens (`FeatureStore` keys)."""
        taps = ",".join(map(str, self.drafter.config.tap_layers))
        return f"{self.fingerprint}|{self.target.dtype}|taps={taps}|greedy={self.cfg.distill}"

    def _feature_key(self, i: int) -> str:
        """The store key of training sequence `i` (as truncated for training), from its host-side tokens:
        hashing a device tensor would sync the device for every sequence of every step."""
        if i not in self._feature_keys:
            self._feature_keys[i] = self.store.key(self.train_set[i].tokens[:self.cfg.max_seq_len])
        return self._feature_keys[i]

    def _with_cached_taps(self, batch: Batch, idx: list[int]) -> Batch:
        """Attach the batch's target taps (and greedy picks, when distilling) from the feature store,
        filling it first while it has room; without room, the loss runs the target over the batch.

        The target pass dominates a step (SmolLM2 on 2 busy CPU cores, batch 4, 32 anchors, 1 drafter
        layer: 29 s per step with it, 5.5 s without), and small datasets are seen for many epochs,
        so each sequence's taps are computed once.
        """
        rows = []
        for i in idx:
            key = self._feature_key(i)
            features = self.store.get(key)
            if features is None and self.store.can_store():
                tokens = Batch.of([self.train_set[i]], self.cfg.max_seq_len, self.device).tokens  # [1, S_i]
                # One sequence per target pass: a padded batch of random lengths wasted 45% of its
                # positions on padding here (8 sequences of ~270 tokens padded to 388).
                taps, greedy = target_features(self.target, tokens, self.drafter.config.tap_layers, self.cfg.distill)
                features = [t[0] for t in taps] + ([] if greedy is None else [greedy[0]])  # each [len, …]
                self.store.put(key, features)
            if features is None:
                return batch
            rows.append(features)
        S = batch.tokens.shape[1]
        stacked = []
        for column in zip(*rows, strict=True):
            # Right-pad the first dimension to S: taps are [len, H], greedy picks [len].
            stacked.append(torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, S - r.shape[0])) for r in column]))
        if self.cfg.distill:
            return replace(batch, taps=stacked[:-1], greedy_next=stacked[-1])
        return replace(batch, taps=stacked)

    def _loss(self, batch: Batch, gen: torch.Generator) -> StepStats:
        cfg = self.cfg
        return dflash_loss(self.drafter, self.target, batch, cfg.num_anchors, cfg.gamma, gen, self.label_map,
                           cfg.distill, cfg.mixed_precision)

    def _step(self) -> float:
        self.drafter.train()
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.step)
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.lr * self.lr_factor()
        stats = self._loss(self._batch(self.step), gen)
        self.supervised_seen += stats.supervised
        self.first_drafts_seen += stats.first_drafts
        self.opt.zero_grad(set_to_none=True)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.opt.step()
        return stats.loss.item()

    def lr_factor(self) -> float:
        """The schedule's factor for the current step and time spent."""
        cfg = self.cfg
        time_fraction = self.elapsed / cfg.max_seconds if cfg.max_seconds is not None else 0.0
        return lr_factor(self.step, cfg.max_steps, cfg.warmup_ratio, time_fraction)

    @torch.no_grad()
    def heldout_loss(self) -> tuple[float, float]:
        """Mean weighted loss and draft accuracy on the held-out split, with fixed anchors."""
        self.drafter.eval()
        gen = torch.Generator().manual_seed(self.cfg.seed)
        losses, correct, total = [], 0, 0
        for batch in self._heldout_batches():
            s = self._loss(batch, gen)
            losses.append(float(s.loss))
            correct, total = correct + s.correct, total + s.supervised
        return sum(losses) / len(losses), correct / max(1, total)

    def _heldout_batches(self) -> list[Batch]:
        """The held-out split in batches with the target's features attached, computed once: the
        target pass took 6 of the 12 s of each evaluation of 10 SmolLM2 sequences here."""
        if self.heldout_batches is None:
            self.heldout_batches = []
            for i in range(0, len(self.heldout), self.cfg.batch_size):
                batch = Batch.of(self.heldout[i:i + self.cfg.batch_size], self.cfg.max_seq_len, self.device)
                self.heldout_batches.append(with_target_features(batch, self.target, self.drafter.config.tap_layers,
                                                                 self.cfg.distill))
        return self.heldout_batches

    def response_tokens_seen(self) -> int:
        """Response tokens in the batches trained on so far (epochs counted again)."""
        n, bs = len(self.train_set), self.cfg.batch_size
        per_epoch = sum(len(s.response) for s in self.train_set)
        epochs, rest = divmod(self.step * bs, n)
        if not rest:
            return epochs * per_epoch
        return epochs * per_epoch + sum(len(self.train_set[i].response) for i in self._epoch_order(epochs)[:rest])

    def _epoch_order(self, epoch: int) -> list[int]:
        """The training sequences' order in `epoch`: a function of the seed and the epoch only, so a
        resumed run repeats the same batches. The last epoch's order is kept, not redrawn per item."""
        if self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
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
        bs = self.cfg.batch_size
        span = bs * 16  # sort within windows of 16 batches: lengths even out, order stays random
        length = [len(s.prompt) + len(s.response) for s in self.train_set]
        by_len = [i for c in range(0, len(order), span) for i in sorted(order[c:c + span], key=length.__getitem__)]
        full = len(by_len) // bs
        batches = [by_len[b * bs:(b + 1) * bs] for b in torch.randperm(full, generator=gen).tolist()]
        return [i for batch in batches for i in batch] + by_len[full * bs:]  # a short last batch stays last

    def heldout_tau(self) -> float:
        """τ of greedy speculative decoding replayed over the held-out split with the current weights."""
        from engine.acceptance import replay
        from engine.dflash_proposer import DFlashProposer

        # The proposer casts its drafter to the target's dtype in place: give it a copy.
        proposer = DFlashProposer(copy.deepcopy(self.drafter), self.target)
        return replay(proposer, self.heldout, self.target, batch_size=self.cfg.batch_size).tau

    def _evaluate(self) -> bool:
        """Record held-out loss; True when training should stop early."""
        loss, acc = self.heldout_loss()
        point = {"step": self.step, "seconds": round(self.elapsed, 1), "heldout_loss": loss, "heldout_accuracy": acc,
                 "response_tokens_seen": self.response_tokens_seen(), "supervised_seen": self.supervised_seen,
                 "first_drafts_seen": self.first_drafts_seen}
        if self.cfg.eval_tau:
            point["heldout_tau"] = self.heldout_tau()
        self.history.append(point)
        # A run in the background (no progress bar) is otherwise silent until it ends.
        log.info("step %d (%.1f min): held-out loss %.3f, accuracy %.1f%%%s", self.step, self.elapsed / 60, loss,
                 100 * acc, f", tau {point['heldout_tau']:.3f}" if "heldout_tau" in point else "")
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.bad_evals = loss, 0
            self.best_state = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
            return False
        self.bad_evals += 1
        return self.bad_evals >= self.cfg.patience

    def advance(self, until: int) -> str | None:
        """Train up to step `until`; the reason when a budget or early stopping ended training, else None."""
        cfg = self.cfg
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not cfg.progress, desc="train-drafter")
        t0, start_step = time.monotonic(), self.step
        start = t0 - self.elapsed
        reason = None
        while reason is None and self.step < min(until, cfg.max_steps):
            self.last_loss = self._step()
            self.step += 1
            self.elapsed = time.monotonic() - start
            bar.update(1)
            bar.set_postfix(loss=f"{self.last_loss:.3f}", lr=f"{self.opt.param_groups[0]['lr']:.1e}")
            if self.heldout and self.step % cfg.eval_every == 0 and self._evaluate():
                reason = "early_stop"
            elif cfg.max_seconds is not None and self.elapsed >= cfg.max_seconds:
                reason = "max_seconds"
            if self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
        bar.close()
        self.steps_per_second = (self.step - start_step) / max(1e-9, time.monotonic() - t0)
        return reason or ("max_steps" if self.step >= cfg.max_steps else None)

    def run(self) -> TrainResult:
        """Train until `max_steps`, the wall-clock budget or early stopping; write the artifact (best weights)."""
        reason = self.advance(self.cfg.max_steps) or "max_steps"
        if self.heldout and (not self.history or self.history[-1]["step"] != self.step):
            self._evaluate()
        self.save_checkpoint()
        return self._finish(reason)

    def _finish(self, reason: str) -> TrainResult:
        if self.best_state is not None:
            self.drafter.load_state_dict(self.best_state)
        train_tokens = sum(len(s.response) for s in self.train_set)
        lineage = Lineage(self.data_digest, self.step, self.cfg.seed, {
            "train_sequences": len(self.train_set), "heldout_sequences": len(self.heldout),
            "train_response_tokens": train_tokens, "best_heldout_loss": self.best_loss,
            "warm_start": self.cfg.init_from, "seconds": round(self.elapsed, 1), "stop_reason": reason,
        })
        path = save_drafter(self.out, self.drafter, self.fingerprint, lineage)
        features = {"computed": self.store.misses, "read_from_disk": self.store.disk_hits,
                    "evicted_from_disk": self.store.evicted}
        return TrainResult(path, self.step, self.elapsed, self.steps_per_second, train_tokens, self.last_loss,
                           self.best_loss, reason, self.history, features)

    def save_checkpoint(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {
            "drafter": self.drafter.state_dict(), "opt": self.opt.state_dict(),
            "step": self.step, "elapsed": self.elapsed, "best_loss": self.best_loss, "best_state": self.best_state,
            "bad_evals": self.bad_evals, "history": self.history, "data_digest": self.data_digest,
            "supervised_seen": self.supervised_seen, "first_drafts_seen": self.first_drafts_seen,
            "config": asdict(self.drafter.config),
        }
        tmp = self.out / (CHECKPOINT + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / CHECKPOINT)

    def _load_checkpoint(self) -> None:
        state = torch.load(self.out / CHECKPOINT, map_location=self.device, weights_only=False)
        if state["data_digest"] != self.data_digest:
            raise ValueError(f"{self.out / CHECKPOINT} was trained on other data ({state['data_digest']}); "
                             "use another out_dir or resume=False")
        if state["config"] != asdict(self.drafter.config):
            raise ValueError(f"{self.out / CHECKPOINT} has another drafter architecture; use another out_dir")
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.elapsed, self.bad_evals = state["step"], state["elapsed"], state["bad_evals"]
        self.supervised_seen = state.get("supervised_seen", 0)
        self.first_drafts_seen = state.get("first_drafts_seen", 0)
        self.best_loss, self.best_state, self.history = state["best_loss"], state["best_state"], state["history"]

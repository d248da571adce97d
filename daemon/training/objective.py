"""The DFlash block objective: a batch, its anchors and labels, and the weighted block cross-entropy.

Objective (one step, per the DFlash paper): the frozen target's tapped hidden states over whole
sequences come attached to the batch (`daemon/training/target_features.py`); sample random anchor
positions inside each response; each anchor p starts a block `[token p, mask × (B−1)]` that sees
the context features at positions `< p` and its own block (`specloop.engine.speculation.dflash.block_mask`,
attended as `SeparateBlocks`); block position k (1 ≤ k < B) is trained with cross-entropy to
predict token p + k, weighted by exp(−(k−1)/γ): a draft only counts when every draft before it
was accepted, so early positions matter most.

Distillation (`distill`): anchors may also lie in the prompt, and labels are the target's own
greedy predictions from the same pass (the argmax after position p + k − 1) rather than the stored
tokens. Position k is supervised only while the stored tokens p+1 .. p+k−1 agree with those
predictions, i.e. while the sequence is still the path greedy decoding would have taken; on the
target's own greedy responses this changes nothing, and every prompt position adds an exact
first-draft label for the price of the pass that computes the taps anyway.

Not here: running the target (`target_features.py`), gradients and the LR (`optimizer_step.py`),
which sequences a batch holds (`data_order.py`), the drafter's layers (`engine/speculation/dflash.py`).
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from specloop.daemon.training.config import TrainConfig
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.dflash import DFlashDrafter, SeparateBlocks, context_mask
from specloop.kernels.cpu_decode import cpu_plan
from specloop.storage.sequences import TokenSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, S] long, right-padded with 0
    prompt_lens: torch.Tensor  # [B] long
    lengths: torch.Tensor  # [B] long
    taps: list[torch.Tensor] | None = None  # target layer outputs, each [B, S, H], once attached
    greedy_next: torch.Tensor | None = None  # [B, S] long: the target's argmax after each position (distill)
    skipped: torch.Tensor | None = None  # [B, S] bool: positions no block is anchored at (None: none)

    @classmethod
    def of(cls, seqs: list[TokenSequence], max_len: int, device: torch.device,
           skipped: list[torch.Tensor] | None = None) -> "Batch":
        """`skipped[i]`: `[len(row i)]` bool, the positions of row i to anchor no block at."""
        rows = [s.tokens[:max_len] for s in seqs]
        S = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), S, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        prompt_lens = torch.tensor([min(len(s.prompt), max_len) for s in seqs])
        lengths = torch.tensor([len(r) for r in rows])
        mask = None
        if skipped is not None:
            assert [s.shape for s in skipped] == [(len(r),) for r in rows], "one mask per row, as long as it"
            mask = pad_sequence(skipped, batch_first=True).to(device)  # [B, S]
        return cls(tokens.to(device), prompt_lens.to(device), lengths.to(device), skipped=mask)


def sample_anchors(batch: Batch, num_anchors: int, gen: torch.Generator,
                   in_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors `[B, N]` (ascending) and keep `[B, N]` bool: N random distinct response positions per row
    (any position after the first with `in_prompt`) that have at least one token after them and are
    not `batch.skipped`; rows with fewer valid positions keep only those."""
    B, S = batch.tokens.shape
    pos = torch.arange(S, device=batch.tokens.device)
    first = torch.ones_like(batch.prompt_lens) if in_prompt else batch.prompt_lens
    valid = (pos >= first.view(-1, 1)) & (pos < batch.lengths.view(-1, 1) - 1)  # [B, S]
    if batch.skipped is not None:
        valid &= ~batch.skipped
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


def dflash_loss(drafter: DFlashDrafter, target: Transformer, head: torch.Tensor, batch: Batch, num_anchors: int,
                gamma: float, gen: torch.Generator, label_map: torch.Tensor | None = None, distill: bool = False,
                mixed_precision: bool = False) -> StepStats:
    """The weighted block cross-entropy of one batch, whose target features are attached. `head` `[V', H]`
    is `drafter.head_weight(target.lm_head)`; `label_map` `[V]` maps token ids to trimmed-vocab indices
    (−100 for tokens outside it, which are not supervised)."""
    assert batch.taps is not None and (batch.greedy_next is not None or not distill), "attach the target's features"
    c = drafter.config
    bs, (B, S) = c.block_size, batch.tokens.shape
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
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=mixed_precision):
        logits = (hidden.view(B, N, bs, -1)[supervised] @ head.to(hidden.dtype).T).float()  # [M, V']
    targets = labels[supervised]
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    correct = int((logits.argmax(-1) == targets).sum())
    return StepStats(loss, correct, int(targets.numel()), int(supervised[..., 1].sum()))


def label_map(drafter: DFlashDrafter, device: torch.device) -> torch.Tensor | None:
    """`[V]`: each token id's index in the drafter's trimmed output vocabulary, −100 outside it; None untrimmed."""
    if not drafter.trimmed:
        return None
    m = torch.full((drafter.config.vocab_size,), -100, dtype=torch.long, device=device)
    m[drafter.vocab_ids] = torch.arange(drafter.vocab_ids.numel(), device=device)
    return m


class BlockLoss:
    """`dflash_loss` with one run's drafter, target and settings: what training steps and held-out
    evaluation both compute."""

    def __init__(self, cfg: TrainConfig, drafter: DFlashDrafter, target: Transformer) -> None:
        self.cfg, self.drafter, self.target = cfg, drafter, target
        self.label_map = label_map(drafter, target.device)
        # Formed once: a trimmed head is a gather, and a GGUF target's head dequantizes on each read
        # (14 ms for SmolLM2's Q8_0 head in fp32 on the Zen 3, beside a training step of about 600 ms).
        self.head = drafter.head_weight(target.lm_head).detach()  # [V', H]
        if cfg.mixed_precision and target.device.type == "cpu" and not cpu_plan().onednn_bf16:
            # On a Xeon without AVX-512 BF16 the block-4 recipe with bf16 autocast did not finish 100 steps
            # in 10 minutes (over 6 s a step); in fp32 it took 2.8 s a step computing the target's features
            # and 0.9 s with them cached.
            log.warning("--mixed-precision on this CPU runs bf16 matrix products through oneDNN's emulation "
                        "(%s): expect it several times slower than fp32", cpu_plan().reason)

    def __call__(self, batch: Batch, gen: torch.Generator) -> StepStats:
        cfg = self.cfg
        return dflash_loss(self.drafter, self.target, self.head, batch, cfg.num_anchors, cfg.gamma, gen,
                           self.label_map, cfg.distill, cfg.mixed_precision)

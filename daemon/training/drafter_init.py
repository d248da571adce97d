"""The drafter a training run starts from: a fresh one shaped for the target, or a warm start.

`build_drafter` makes a new `DFlashDrafter` from the config (seeded, its mask embedding the
target's mean token embedding) or loads the `--init-from` artifact, then widens its trimmed
vocabulary to the new data (`widen_vocab`) and gives it the depth and block size asked for
(`reconfigure`), keeping every learned weight and the drafter's outputs.

A warm start may come from a drafter of another base model whose shape the target has (the dense
model an NVFP4 one was quantized from, a fine-tune's parent). Its weights are only where training
starts: the run trains on this target's taps and answers and the artifact is this target's, as the
daemon's bootstrap (`daemon/retrain/bootstrap.py`) trains a new base model's first drafter on its
own answers to another model's prompts. The artifact's lineage names the parent's base model.

Not here: the drafter's layers (`engine/speculation/dflash.py`), the artifact's files
(`engine/speculation/drafter_artifact.py`), resuming a stopped run (`checkpoint.py`).
"""

from dataclasses import asdict

import torch

from specloop.daemon.training.config import TrainConfig
from specloop.engine.model.transformer import Transformer
from specloop.engine.speculation.dflash import DFlashConfig, DFlashDrafter
from specloop.engine.speculation.drafter_artifact import load_drafter
from specloop.storage.sequences import TokenSequence


def build_drafter(cfg: TrainConfig, target: Transformer, train: list[TokenSequence]) -> DFlashDrafter:
    """A fresh drafter for `target`, or the warm-start artifact's drafter (its trimmed vocabulary
    widened to the new responses' tokens when `trim_vocab`, reshaped by `reconfigure`)."""
    vocab = sorted({t for s in train for t in s.response}) if cfg.trim_vocab else None
    if cfg.init_from:
        # No fingerprint check (see above); a drafter of another model must still fit the target's shape.
        drafter = load_drafter(cfg.init_from, None).drafter
        try:
            drafter.config.check_target(target.config)
        except ValueError as e:
            raise ValueError(f"init_from {cfg.init_from}: {e}") from e
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

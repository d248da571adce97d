"""The DFlash block objective's pieces: padded batches and per-position loss weights."""

import torch

from specloop.daemon.training.objective import Batch, position_weights
from specloop.storage.sequences import TokenSequence


def test_position_weights_decay_after_the_anchor() -> None:
    w = position_weights(4, 2.0, torch.device("cpu"))
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[2:], torch.exp(torch.tensor([-0.5, -1.0])))


def test_batch_pads_and_truncates() -> None:
    b = Batch.of([TokenSequence((1, 2), (3, 4, 5)), TokenSequence((1,), (2,))], max_len=4, device=torch.device("cpu"))
    assert b.tokens.tolist() == [[1, 2, 3, 4], [1, 2, 0, 0]]
    assert b.lengths.tolist() == [4, 2] and b.prompt_lens.tolist() == [2, 1]

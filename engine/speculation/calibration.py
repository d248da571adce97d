"""How often a proposer's estimates of acceptance come true, learned from verify passes, and the
estimates corrected by it before the engine prices a pass with them.

Suffix decoding estimates that a draft is accepted (with every draft before it) as the share of a
match's occurrences that agree on it, so a continuation that followed every occurrence, however few,
is estimated certain. On the demo's formal-logic traces (one cycle's 109, the first 60 as history,
Zen 3) 88% of the drafts were estimated 1.0, and 71% of those were accepted; drafts estimated
0.5-0.6 were accepted 32% of the time. Priced as certain, every draft was verified whatever a wider
pass cost (`engine/runtime/verify_cost.py`). Corrected per draft position and estimate, the width
rule's modelled decode speed at batch 1 rose from 289 to 341 tok/s on those traces (`gguf`
pass costs, the proposing left out); docs/performance.md has the live figures.

The table: per draft position j < k and estimate bin (tenths, and 1.0 exactly on its own), how many
drafts were verified and how many accepted. A corrected estimate is (accepted + s p) / (verified +
s): the proposer's own p counts as s = `strength` observations, so an empty cell returns p. Past
`window` verified drafts a cell's counts halve, so the table follows traffic as it changes. Only
verified drafts are counted (a draft the rule chose not to verify says nothing). Estimates are kept
non-increasing along a row (a draft is accepted only with all before it).

Counts only, across tenants: no token is kept. Not here: the estimates (`engine/speculation/suffix.py`),
the width rule (`engine/runtime/verify_cost.py`).
"""

from dataclasses import dataclass, field

import numpy as np
import torch

BINS = 10  # estimates in [0.1 i, 0.1 (i + 1)) share a cell; exactly 1.0 has its own (bin BINS)


def estimate_bins(p: torch.Tensor) -> torch.Tensor:
    """Each estimate's bin `[...]` long: 0 .. BINS − 1 by tenths, BINS for an estimate of 1 (or more)."""
    return torch.where(p >= 1, BINS, (p * BINS).long().clamp(0, BINS - 1))


@dataclass
class AcceptanceCalibration:
    positions: int  # draft positions a row may have (k)
    strength: float = 10.0  # verified drafts the proposer's own estimate counts as
    window: float = 2000.0  # verified drafts a cell holds before its counts halve
    verified: np.ndarray = field(init=False, repr=False)  # [positions, BINS + 1]
    accepted: np.ndarray = field(init=False, repr=False)  # [positions, BINS + 1]

    def __post_init__(self) -> None:
        if self.positions < 1 or self.strength <= 0 or self.window <= 0:
            raise ValueError(f"need positions >= 1, strength > 0 and window > 0, got {self.positions}, "
                             f"{self.strength}, {self.window}")
        self.verified = np.zeros((self.positions, BINS + 1))
        self.accepted = np.zeros((self.positions, BINS + 1))

    def correct(self, confidence: torch.Tensor) -> torch.Tensor:
        """Estimates `[B, k]` (0 where a row has no draft) → corrected estimates `[B, k]`."""
        B, k = confidence.shape
        assert k <= self.positions
        cells = (np.arange(k)[None, :].repeat(B, 0), estimate_bins(confidence).numpy())  # [B, k] each
        p = confidence.double().numpy()
        corrected = (self.accepted[cells] + self.strength * p) / (self.verified[cells] + self.strength)
        corrected = torch.from_numpy(np.where(p > 0, corrected, 0.0)).to(confidence.dtype)
        return torch.cummin(corrected, dim=1).values

    def record(self, confidence: torch.Tensor, verified: list[int], accepted: list[int]) -> None:
        """After a verify pass: row b's estimates `confidence[b]` (as proposed, uncorrected), of which its
        first `verified[b]` drafts were verified and its first `accepted[b]` accepted."""
        B, k = confidence.shape
        assert len(verified) == len(accepted) == B
        rows = [b for b in range(B) for _ in range(min(verified[b], k))]
        if not rows:
            return
        cols = [j for b in range(B) for j in range(min(verified[b], k))]
        cells = (np.asarray(cols), estimate_bins(confidence[rows, cols]).numpy())
        np.add.at(self.verified, cells, 1.0)
        np.add.at(self.accepted, cells, [float(accepted[b] > j) for b, j in zip(rows, cols, strict=True)])
        full = self.verified > self.window
        self.verified[full] /= 2
        self.accepted[full] /= 2

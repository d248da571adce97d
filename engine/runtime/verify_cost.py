"""How wide a verify pass should be: the number of draft positions that maximizes the tokens a step
is expected to commit per second of the target's pass.

On a CPU the target's pass costs a fixed part (reading the weights) plus a part per position
verified, and a batch verifies every row as wide as its widest draft. Suffix decoding drafts up to
15 tokens when a match is long, so one confident row can make eight rows verify 16 positions each:
on 72 held-out evals answers replayed 8 at a time on a Zen 3, suffix decoding at block 16 reached τ
3.19 against n-gram lookup's 2.44 at block 4, yet decoded 0.59x as fast (modelled). So each step
keeps the j draft columns that maximize

    (B + Σ_rows Σ_{i<j} p[row, i]) / cost(B · (j + 1))

where p[row, i] is the proposer's estimate that the row's draft i is accepted (and all before it),
and `cost` is this machine's measured pass time (`LLMEngine.verify_cost`, measured per engine on a
small cache of its own, again while the fit says a position costs nothing). Proposers without estimates count every draft as certain: the width is then the
longest draft. On the CPU a pass stays within the fused kernel's rows (`exact_num_drafts`), so that
greedy outputs equal plain decoding's whatever the batch.

Not here: what is accepted (`engine/speculation/verify.py`), the daemon's model of a whole step
(`daemon/evaluation/step_cost.py`).
"""

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from specloop.engine.cpu.fused_decode import MAX_ROWS
from specloop.engine.model.transformer import Transformer
from specloop.engine.runtime.model_runner import ModelRunner
from specloop.engine.runtime.sequence import SamplingParams, Sequence

CONTEXT = 128  # cached positions each row attends to while measured
REPEATS = 3


@dataclass(frozen=True)
class Linear:
    """`fixed_s + per_unit_s × units` seconds."""

    fixed_s: float
    per_unit_s: float

    def __call__(self, units: int | torch.Tensor) -> float | torch.Tensor:
        return self.fixed_s + self.per_unit_s * units

    @classmethod
    def fit(cls, units: list[int], seconds: list[float]) -> "Linear":
        per_unit, fixed = np.polyfit(units, seconds, 1)
        return cls(max(float(fixed), 1e-6), max(float(per_unit), 0.0))


def median_seconds(run, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 1):  # the first warms caches and kernels up
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


@torch.inference_mode()
def measure_pass(model: Transformer, shapes: list[tuple[int, int]], context: int = CONTEXT) -> Linear:
    """The target's pass (logits of every position included) over `[B, w]` blocks, for each (B, w) in
    `shapes`, fitted per position; on a KV cache of its own, so nothing being served is touched."""
    context = min(context, model.config.max_position // 2)
    batch, width = max(b for b, _ in shapes), max(w for _, w in shapes)
    runner = ModelRunner(model, batch, context + width, slack=0)
    units, seconds = [], []
    for b, w in shapes:
        seqs = [Sequence([0], SamplingParams(), slot=i, num_cached=context) for i in range(b)]
        block = torch.zeros(b, w, dtype=torch.long)
        units.append(b * w)
        seconds.append(median_seconds(lambda seqs=seqs, block=block: runner.run_block(seqs, block, ())))
    return Linear.fit(units, seconds)


def exact_num_drafts(model: Transformer, batch: int) -> int | None:
    """The most draft columns a pass of `batch` rows may verify and still run as plain decoding runs (None:
    any). On the CPU, passes beyond the fused kernel's rows run eager, with other numerics, and greedy
    answers change with the load (docs/performance.md, "Passes of up to 32 rows in the kernel")."""
    if model.fused_decoder is None:
        return None
    return max(0, MAX_ROWS // batch - 1)


def best_num_drafts(confidence: torch.Tensor, lengths: torch.Tensor, cost: Linear, limit: int | None = None) -> int:
    """Draft columns to verify, at most `limit`, from `confidence` `[B, k]` (estimated acceptance of each
    draft) and each row's draft `lengths` `[B]`."""
    B, k = confidence.shape
    longest = int(lengths.max()) if limit is None else min(int(lengths.max()), limit)
    if longest == 0:
        return 0
    held = torch.arange(longest).view(1, -1) < lengths.view(-1, 1)  # [B, k']
    gained = (confidence[:, :longest].float() * held).sum(dim=0).cumsum(dim=0)  # [k']
    expected = B + torch.cat([torch.zeros(1), gained])  # [k'+1]: committed tokens with j drafts verified
    seconds = cost(B * torch.arange(1, longest + 2, dtype=torch.float64))  # [k'+1]
    return int((expected / seconds).argmax())

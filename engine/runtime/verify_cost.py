"""How wide a verify pass should be: the number of draft positions that maximizes the tokens a step
is expected to commit per second of the target's pass.

On a CPU the target's pass costs a fixed part (reading the weights) plus a part per position
verified, and a batch verifies every row as wide as its widest draft. Suffix decoding drafts up to
15 tokens when a match is long, so one confident row can make eight rows verify 16 positions each:
on 72 held-out evals answers replayed 8 at a time on a Zen 3, suffix decoding at block 16 reached τ
3.19 against n-gram lookup's 2.44 at block 4, yet decoded 0.59x as fast (modelled). So each step
keeps the j draft columns that maximize

    (B + Σ_rows Σ_{i<j} p[row, i]) / cost(B · (j + 1))

where p[row, i] is the proposer's estimate that the row's draft i is accepted (and all before it;
suffix decoding's corrected by what this engine's passes accepted, `engine/speculation/calibration.py`),
and `cost` is this machine's measured pass time over B·(j+1) positions (`LLMEngine.verify_cost`, a
`PassCost` measured per engine on a small cache of its own, again while it says positions cost
nothing) plus the rest of the step, which every width pays (`WithStep`: the engine's running mean
of a verify step's time outside its pass, 0.7-7.7 ms on the Zen 3, `benchmarks/suffix_width.py`).
Proposers without estimates count every draft as certain: the width is then the longest draft. On the CPU a pass stays within the fused kernel's rows (`exact_num_drafts`), so that
greedy outputs equal plain decoding's whatever the batch.

Not here: what is accepted (`engine/speculation/verify.py`), the daemon's model of a whole step
(`daemon/evaluation/step_cost.py`).
"""

import statistics
import time
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class PassCost:
    """Seconds of the target's pass over `n` positions (B rows of w: n = B·w), interpolated between the
    measured ones, and along the last two past them.

    A pass's cost is mostly a function of its positions, in steps that no line follows. SmolLM2 bf16
    on an AMX Xeon (one run, `benchmarks/pass_cost.py`), the fastest shape of each: 11.6 ms at 1
    position, 15.8 at 4, 21.6 at 8, 37.3 at 16, 65.6 at 32, then 54.6 at 64 (past the fused kernel's
    32 rows oneDNN takes the pass) and 81.7 at 128. The line fitted over them priced 1 position at
    22.9 ms and 32 at 39.5: 2.6% off on average over 20 shapes interpolated, 32.8% by the line."""

    points: tuple[tuple[int, float], ...]  # (positions, seconds), positions ascending
    _xy: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = [p for p, _ in self.points]
        assert n and n == sorted(set(n)) and n[0] >= 1, self.points
        # Built once: the engine prices a pass at every step.
        object.__setattr__(self, "_xy", tuple(np.array(v, dtype=np.float64) for v in zip(*self.points, strict=True)))

    def __call__(self, positions: int | torch.Tensor) -> float | torch.Tensor:
        x = np.asarray(positions.cpu() if isinstance(positions, torch.Tensor) else positions, dtype=np.float64)
        xs, ys = self._xy
        y = np.interp(x, xs, ys)
        if len(xs) > 1:  # past the widest measured pass, along the last two (never falling)
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
        return torch.from_numpy(y) if isinstance(positions, torch.Tensor) else float(y)

    @property
    def free_positions(self) -> bool:
        """Whether the widest pass measured no dearer than the narrowest: never so on a quiet machine."""
        return len(self.points) > 1 and self.points[-1][1] <= self.points[0][1]

    @classmethod
    def fit(cls, seconds: dict[tuple[int, int], float]) -> "PassCost":
        """From median seconds per measured `(batch, width)`; shapes of equal positions are averaged."""
        by_positions: dict[int, list[float]] = {}
        for (b, w), s in seconds.items():
            by_positions.setdefault(b * w, []).append(s)
        return cls(tuple((n, statistics.fmean(by_positions[n])) for n in sorted(by_positions)))


@dataclass(frozen=True)
class WithStep:
    """A pass's cost plus the rest of its step (proposing, sampling, committing), which a step pays
    whatever its width: priced without it, wider passes look dearer than they are."""

    cost: "PassCost | Linear"
    step_s: float

    def __call__(self, positions: int | torch.Tensor) -> float | torch.Tensor:
        return self.cost(positions) + self.step_s


def pass_shapes(batch: int, width: int) -> list[tuple[int, int]]:
    """The shapes a pass is measured at: one row and `batch` rows, each at widths 1, 2, 4, ... `width`."""
    widths = sorted({min(width, 2 ** i) for i in range(width.bit_length() + 1)})
    return sorted({(b, w) for b in (1, batch) for w in widths})


def median_seconds(run, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 1):  # the first warms caches and kernels up
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


@torch.inference_mode()
def measure_pass(model: Transformer, shapes: list[tuple[int, int]], context: int = CONTEXT) -> PassCost:
    """The target's pass (logits of every position included) over `[B, w]` blocks, for each (B, w) in
    `shapes`; on a KV cache of its own, so nothing being served is touched."""
    context = min(context, model.config.max_position // 2)
    batch, width = max(b for b, _ in shapes), max(w for _, w in shapes)
    runner = ModelRunner(model, batch, context + width, slack=0)
    seconds = {}
    for b, w in shapes:
        seqs = [Sequence([0], SamplingParams(), slot=i, num_cached=context) for i in range(b)]
        block = torch.zeros(b, w, dtype=torch.long)
        seconds[(b, w)] = median_seconds(lambda seqs=seqs, block=block: runner.run_block(seqs, block, ()))
    return PassCost.fit(seconds)


def exact_num_drafts(model: Transformer, batch: int) -> int | None:
    """The most draft columns a pass of `batch` rows may verify and still run as plain decoding runs (None:
    any). On the CPU, passes beyond the fused kernel's rows run eager, with other numerics, and greedy
    answers change with the load (docs/performance.md, "Passes of up to 32 rows in the kernel")."""
    if model.fused_decoder is None:
        return None
    return max(0, MAX_ROWS // batch - 1)


def best_num_drafts(confidence: torch.Tensor, lengths: torch.Tensor, cost: PassCost | Linear | WithStep,
                    limit: int | None = None) -> int:
    """Draft columns to verify, at most `limit`, from `confidence` `[B, k]` (estimated acceptance of each
    draft) and each row's draft `lengths` `[B]`."""
    B, k = confidence.shape
    longest = int(lengths.max()) if limit is None else min(int(lengths.max()), limit)
    if longest == 0:
        return 0
    if bool((confidence[:, :longest] >= 1).all()):  # drafts counted certain are all verified, whatever a
        return longest  # pass of more positions costs: τ then measures the drafter (and the canary's probes)
    held = torch.arange(longest).view(1, -1) < lengths.view(-1, 1)  # [B, k']
    gained = (confidence[:, :longest].float() * held).sum(dim=0).cumsum(dim=0)  # [k']
    expected = B + torch.cat([torch.zeros(1), gained])  # [k'+1]: committed tokens with j drafts verified
    seconds = cost(B * torch.arange(1, longest + 2, dtype=torch.float64))  # [k'+1]
    return int((expected / seconds).argmax())

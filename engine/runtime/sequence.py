"""Per-request state inside the engine: sampling parameters, the sequence, and what it streams out.

A `Sequence` is owned by the engine thread; the API side only ever sees `TokenDelta`s. Lengths are
derived, not stored twice: `num_cached` (tokens whose K/V sit in the slot) is the one counter that
speculation rolls back.
"""

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specloop.engine.runtime.logprobs import MAX_TOP, TokenLogprob

if TYPE_CHECKING:
    from specloop.engine.runtime.grammar import Grammar
    from specloop.engine.speculation.proposer import ServedDrafter


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. Validated here; the API maps its own errors onto these."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculate: bool = True  # per-request opt-out; greedy output is identical either way, sampled output
    # has the same distribution but other draws (a verify pass draws k+1 samples, keeps the accepted ones)
    logprobs: int | None = None  # each emitted token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo); then max_tokens may be 0
    # Verify every draft, whatever it is expected to cost (engine/runtime/verify_cost.py): the canary's
    # probes, whose τ must measure the drafter and not the width the engine chose for the load.
    verify_all_drafts: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (0 only with prompt log-probabilities), got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP:
                raise ValueError(f"{name} must be in [0, {MAX_TOP}], got {value}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters for one sequence, with vLLM's meaning (docs/architecture.md, "Acceptance numbers")."""

    drafts: int = 0  # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts
        self.drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per verify step, the bonus token included (1 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @classmethod
    def pooled(cls, stats: Iterable["SpecStats"]) -> "SpecStats":
        """The counters of many sequences summed, per position included (τ pooled over all of them)."""
        total = cls()
        for s in stats:
            total.drafts += s.drafts
            total.draft_tokens += s.draft_tokens
            total.accepted_tokens += s.accepted_tokens
            if len(total.accepted_per_position) < len(s.accepted_per_position):
                missing = len(s.accepted_per_position) - len(total.accepted_per_position)
                total.accepted_per_position.extend([0] * missing)
            for i, a in enumerate(s.accepted_per_position):
                total.accepted_per_position[i] += a
        return total


@dataclass
class TokenDelta:
    """What one engine step produced for one request: new tokens, and on the last one why it ended."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" (waited past its deadline) | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats | None = None
    drafter_version: str | None = None  # the drafter that drafted for this request, if one did
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first delta, when asked: None for token 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    num_cached: int = 0  # tokens whose K/V are in the slot; the last committed token never is
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    drafter: "ServedDrafter | None" = None  # set at the first prefill chunk, kept for the sequence's life
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # filled chunk by chunk, if asked
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    grammar: "Grammar | None" = None  # structured output: what the next token may be (engine/runtime/grammar.py)
    tenant: str = ""  # whose request: slots are shared fairly between tenants (engine/runtime/scheduler.py)
    suffix_cache: bool = True  # may draft from, and add to, its tenant's in-memory suffix cache
    deadline: float | None = None  # time.monotonic() by which it must hold a slot, or it ends with "timeout"

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt must contain at least one token")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

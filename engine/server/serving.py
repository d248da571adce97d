"""One request's life as the API sees it: engine deltas in, safe text pieces out, then a record.

`Generation` streams a tokenized prompt through the engine, turns token ids into whole-character
text, cuts at stop strings (aborting the engine request when one is hit), times the request for
the metrics, and when the request finishes hands a `FinishedRequest` to the `on_finish` hook,
which is where trace capture plugs in. A hook that raises is logged and counted, never allowed to
break the response.

This file knows nothing about HTTP or the OpenAI wire format (`api.py`), and nothing about how
the engine batches (`engine/runtime/llm_engine.py`).
"""

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from specloop.engine.loaders.weight_format import DENSE, WeightFormat
from specloop.engine.model.tokenizer import Tokenizer
from specloop.engine.runtime.grammar import Grammar, GrammarCompiler
from specloop.engine.runtime.llm_engine import LLMEngine
from specloop.engine.runtime.logprobs import TokenLogprob
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.server.detokenizer import Detokenizer, StopStringMatcher
from specloop.engine.server.logprobs_format import EmittedLogprobs
from specloop.engine.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedRequest:
    """Everything trace capture needs about one finished request. Times are Unix seconds."""

    request_id: str
    endpoint: str  # "completions" | "chat.completions"
    tenant: str | None  # resolved from the request's API key (`anonymous` without a tenants file)
    user: str | None  # the request's `user` field
    model: str
    fingerprint: str
    prompt_ids: tuple[int, ...]  # as the model saw them, after the chat template
    response_ids: tuple[int, ...]
    prompt_text: str | None  # the rendered prompt; None when the client sent token ids
    response_text: str
    params: SamplingParams
    stop: tuple[str, ...]
    spec: SpecStats | None
    drafter_version: str | None  # the drafter that drafted for this request (None: none, or n-gram lookup)
    finish_reason: str  # "stop" | "length"
    arrived_at: float
    first_token_at: float | None
    finished_at: float


FinishHook = Callable[[FinishedRequest], None]


class EngineFailed(RuntimeError):
    """The engine gave up on this request (its step raised); not the client's fault."""


class QueueTimeout(RuntimeError):
    """The request waited for a KV-cache slot past the server's queue timeout; it may be tried again."""


@dataclass(frozen=True)
class ServingContext:
    """What every request on this server shares."""

    engine: LLMEngine
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model: str
    fingerprint: str
    on_finish: FinishHook | None = None
    weights: WeightFormat = DENSE  # dense, or which parts are served from NVFP4 weights
    quantized_from: str | None = None  # the source model's fingerprint, for an NVFP4 model
    grammars: GrammarCompiler | None = None  # structured output (None: the API builds none)


@dataclass
class RequestInput:
    """A validated, tokenized request."""

    request_id: str
    endpoint: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stop: tuple[str, ...]
    tenant: str | None
    user: str | None
    suffix_cache: bool = True  # the tenant's: may draft from and add to its in-memory suffix cache
    arrived_at: float = field(default_factory=time.time)
    grammar: Grammar | None = None  # structured output: what each token may be


class Generation:
    """Runs one request. Iterate `text()`; afterwards `finish_reason`, `usage` fields are set."""

    def __init__(self, ctx: ServingContext, req: RequestInput) -> None:
        self.ctx = ctx
        self.req = req
        self.response_ids: list[int] = []
        self.response_text = ""
        self.finish_reason: str | None = None
        self.spec: SpecStats | None = None
        self.drafter_version: str | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when the request asked (echo)
        self._logprobs = EmittedLogprobs(ctx.tokenizer, req.prompt_ids) if req.params.logprobs is not None else None
        self._started = time.perf_counter()
        self._first_token_at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.response_ids)

    async def text(self) -> AsyncIterator[str]:
        """Text pieces as they become safe to show; ends when the request finishes.

        Leaving early (the client went away) aborts the engine request and records nothing.
        """
        detok = Detokenizer(self.ctx.tokenizer, self.req.prompt_ids)
        stops = StopStringMatcher(self.req.stop)
        last = self._started
        stream = self.ctx.engine.stream(self.req.prompt_ids, self.req.params, self.req.grammar, self.req.tenant or "",
                                         self.req.suffix_cache)
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                last = self._time_tokens(last, len(delta.token_ids))
                self.response_ids.extend(delta.token_ids)
                self.spec, self.drafter_version = delta.spec, delta.drafter_version
                if delta.prompt_logprobs is not None:
                    self.prompt_logprobs = delta.prompt_logprobs
                if self._logprobs is not None and delta.logprobs:
                    self._logprobs.push(delta.logprobs)
                piece = stops.push(detok.push(delta.token_ids))
                if stops.stopped:
                    self.finish_reason = "stop"
                elif delta.finished:
                    piece += stops.flush()
                    self.finish_reason = delta.finish_reason
                if piece:
                    self.response_text += piece
                    yield piece
                if self.finish_reason is not None:
                    break
        if self.finish_reason == "timeout":
            raise QueueTimeout("the server is busy: this request waited for a free slot past its queue timeout; "
                               "retry later")
        if self.finish_reason not in ("stop", "length"):
            raise EngineFailed(f"the engine could not complete this request (finish_reason {self.finish_reason!r})")
        self._finished()

    def take_logprobs(self) -> list[tuple[int, TokenLogprob]]:
        """(offset in the response text, entry) of the tokens whose text has been sent since the last
        call; none for tokens past a stop string. Empty when the request asked for none."""
        return [] if self._logprobs is None else self._logprobs.take(len(self.response_text))

    def _time_tokens(self, last: float, num_tokens: int) -> float:
        if not num_tokens:
            return last
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = time.time()
            self.ctx.metrics.record_first_token(self.req.endpoint, now - self._started)
        else:
            self.ctx.metrics.record_tokens(now - last, num_tokens)
        return now

    def _finished(self) -> None:
        self.ctx.metrics.record_finished(self.req.endpoint, time.perf_counter() - self._started,
                                         self.prompt_tokens, self.completion_tokens, self.spec,
                                         self.drafter_version)
        if self.ctx.on_finish is None:
            return
        try:
            self.ctx.on_finish(self._record())
        except Exception:
            log.exception("on_finish hook failed for request %s", self.req.request_id)
            self.ctx.metrics.hook_errors.inc()

    def _record(self) -> FinishedRequest:
        assert self.finish_reason is not None
        r = self.req
        return FinishedRequest(
            request_id=r.request_id, endpoint=r.endpoint, tenant=r.tenant, user=r.user,
            model=self.ctx.model, fingerprint=self.ctx.fingerprint,
            prompt_ids=tuple(r.prompt_ids), response_ids=tuple(self.response_ids),
            prompt_text=r.prompt_text, response_text=self.response_text,
            params=r.params, stop=r.stop, spec=self.spec, drafter_version=self.drafter_version,
            finish_reason=self.finish_reason,
            arrived_at=r.arrived_at, first_token_at=self._first_token_at, finished_at=time.time(),
        )

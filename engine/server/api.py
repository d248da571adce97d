"""The HTTP server: an OpenAI-compatible FastAPI app over one loaded model and its engine.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE streaming, in
OpenAI's exact wire format), `/health` (liveness), `/ready` (engine thread alive), `/metrics`.
Every error a client can cause comes back as OpenAI's error JSON with a 4xx status naming the
field; validation errors are 400, not FastAPI's 422. A client that disconnects, streaming or not,
has its engine request aborted so its KV-cache slot is freed.

Every `/v1` request passes the edge first (`edge.py`): `Authorization: Bearer <key>` names the
tenant through the `TenantDirectory` (a key it does not know is a 401 `invalid_api_key`, before the
body is read), admission may refuse it from the headers (429, `admission.py`), and a body over
`max_body_bytes` is a 413. Without a tenants file every request is tenant `anonymous`, never
captured, whatever key the client sends (the openai client always sends one). A route then bounds
the prompt's characters before it templates and tokenizes it, off the event loop (as it compiles a
JSON schema, once per request and cached by digest), and reserves the request's sequences and tokens
with admission before the engine sees it (`limits.py`; docs/api.md, "Limits"). A request that waits
for a slot past the queue timeout is a 503 with `Retry-After`. The subject whose consent decides
capture is the `X-Specloop-User` header when present, else the body's `user` field: the header is
what a gateway in front of the application sets after authenticating the end user, so it is trusted
over what the application put in the body. `/health`, `/ready` and `/metrics` are open; routers in
`extra_routers` (the consent admin API) bring their own authentication.

The app owns the engine's thread: its lifespan starts the engine when the server starts and stops
it at shutdown, after uvicorn has let in-flight requests finish, then runs the `on_shutdown`
callbacks (flushing trace capture). Request orchestration lives in `serving.py`.
"""

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specloop.consent.tenants import TenantDirectory, TenantPolicy
from specloop.engine.loaders.load import LoadedModel
from specloop.engine.runtime.grammar import Grammar, GrammarCompiler
from specloop.engine.runtime.llm_engine import LLMEngine, PromptTooLong
from specloop.engine.runtime.sequence import SamplingParams, SpecStats
from specloop.engine.server.admission import Admission, Ticket
from specloop.engine.server.edge import Edge
from specloop.engine.server.errors import APIError
from specloop.engine.server.limits import RequestLimits
from specloop.engine.server.logprobs_format import chat_logprobs, completion_logprobs, prompt_entries
from specloop.engine.server.metrics import CONTENT_TYPE, ServerMetrics
from specloop.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculationUsage,
    Usage,
    new_id,
    now,
)
from specloop.engine.server.serving import (
    EngineFailed,
    FinishHook,
    Generation,
    QueueTimeout,
    RequestInput,
    ServingContext,
)
from specloop.engine.server.settings import ServerSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
COMPLETIONS, CHAT = "completions", "chat.completions"  # endpoint names in metrics and traces
_ENDPOINTS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}
_OPENAI_DEFAULT_MAX_TOKENS = 16  # what OpenAI's legacy completions endpoint generates when unset
_DISCONNECTED = 499  # nginx's "client closed request", as the status label for aborted requests
SUBJECT_HEADER = "X-Specloop-User"


def build_app(loaded: LoadedModel, engine: LLMEngine, settings: ServerSettings,
              extra_routers: Iterable[APIRouter] = (), on_finish: FinishHook | None = None,
              tenants: TenantDirectory | None = None, metrics: ServerMetrics | None = None,
              on_shutdown: Iterable[Callable[[], None]] = (),
              companions: Iterable[tuple[Callable[[], None], Callable[[], None]]] = ()) -> FastAPI:
    """The app for one model. `on_finish` is called once per finished request (trace capture).

    `extra_routers` are mounted as they are; they reach the shared `ServingContext` (engine,
    tokenizer, metrics) through `request.app.state.serving`. `tenants` maps API keys to tenants
    (None: everyone is `anonymous`). Pass `metrics` when other parts (capture) count on its
    registry; `on_shutdown` runs after the engine has stopped. `companions` are (start, stop) pairs
    of threads that need the running engine (the registry follower): started after it, stopped before.
    """
    metrics = ServerMetrics(engine.stats) if metrics is None else metrics
    tenants = TenantDirectory.load(None) if tenants is None else tenants
    limits = settings.request_limits()
    admission = Admission(engine.config.num_slots, limits, metrics)
    closers, companions = tuple(on_shutdown), tuple(companions)
    ctx = ServingContext(engine=engine, tokenizer=loaded.tokenizer, metrics=metrics,
                         model=settings.served_model_name or loaded.name, fingerprint=loaded.fingerprint,
                         on_finish=on_finish, weights=loaded.weights, quantized_from=loaded.source_fingerprint,
                         grammars=GrammarCompiler(loaded.tokenizer))
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        for start, _ in companions:
            start()
        try:
            yield
        finally:
            for _, stop in companions:
                await asyncio.to_thread(stop)
            await asyncio.to_thread(engine.stop)
            log.info("engine stopped")
            for close in closers:
                await asyncio.to_thread(close)

    app = FastAPI(title="specloop", summary="OpenAI-compatible serving with speculative decoding",
                  lifespan=lifespan)
    app.state.serving = ctx
    _install_error_handlers(app, metrics)
    app.include_router(_ops_router(ctx))
    app.include_router(_openai_router(ctx, limits, admission))
    for router in extra_routers:
        app.include_router(router)
    app.add_middleware(Edge, tenants=tenants, admission=admission, limits=limits, metrics=metrics)
    return app


# ------------------------------------------------------------------------------------------------ errors


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def count(request: Request, status: int) -> None:
        if request.url.path in _ENDPOINTS:
            metrics.record_request(_ENDPOINTS[request.url.path], status)

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.status)
        return exc.response()

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_to_api_error(exc)
        count(request, err.status)
        return err.response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count(request, exc.status_code)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        count(request, 500)
        return APIError(500, "internal server error", kind="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _validation_to_api_error(exc: RequestValidationError) -> APIError:
    """Pydantic's errors as one 400: the first offending top-level field is the `param`."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "decode error")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    fields = [e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"] for e in errors]
    if not fields[0]:
        return APIError(400, _BODY_ERRORS.get(first["type"], _message(first)))
    messages = [f"{'.'.join(str(p) for p in f) or 'body'}: {_message(e)}" for f, e in zip(fields, errors)]
    if first["type"] == "extra_forbidden":  # OpenAI's own answer to a field it does not know
        return APIError(400, f"unrecognized request argument supplied: {'.'.join(str(p) for p in fields[0])} "
                             f"(docs/api.md lists the supported fields)", param=str(fields[0][0]))
    return APIError(400, "; ".join(messages), param=str(fields[0][0]))


_BODY_ERRORS = {
    "missing": "the request body is required: a JSON object",
    "model_attributes_type": "the request body must be a JSON object, sent as Content-Type: application/json",
}


def _message(error: dict) -> str:
    # Our validators' ValueErrors arrive as "Value error, <our message>".
    return error["msg"].removeprefix("Value error, ")


# -------------------------------------------------------------------------------------------- operations


def _ops_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/ready")
    async def ready() -> JSONResponse:
        if ctx.engine.alive:
            return JSONResponse({"status": "ready", "model": ctx.model})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return router


# ------------------------------------------------------------------------------------------ OpenAI API


def _openai_router(ctx: ServingContext, limits: RequestLimits, admission: Admission) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = now()

    @router.get("/models")
    async def models() -> ModelList:
        card = ModelCard(id=ctx.model, created=created, fingerprint=ctx.fingerprint,
                         max_model_len=ctx.engine.config.max_len, drafter_version=ctx.engine.drafter_version,
                         quantized_from=ctx.quantized_from, **ctx.weights.card())
        return ModelList(data=[card])

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        if isinstance(body.prompt, str):
            _check_prompt_chars(limits, len(body.prompt), "prompt")
            prompt_ids = await asyncio.to_thread(ctx.tokenizer.encode, body.prompt, add_special_tokens=True)
            prompt_text = body.prompt
        else:
            prompt_ids, prompt_text = list(body.prompt), None
        # echo with logprobs scores the prompt; echo with max_tokens 0 does only that
        scored = body.logprobs if body.echo and body.logprobs is not None else (0 if body.max_tokens == 0 else None)
        gens, ticket = _choices(ctx, admission, request, body, COMPLETIONS, prompt_ids, prompt_text, "prompt",
                                _OPENAI_DEFAULT_MAX_TOKENS, body.logprobs, scored)
        echo = _Echo(ctx, body, prompt_ids) if body.echo else None
        if body.stream:
            return _sse(ctx, gens, ticket, _completion_events(ctx, gens, body.include_usage, echo))
        texts = await _run_unless_disconnected(ctx, request, gens, ticket)
        shift = len(echo.text) if echo else 0
        choices = [CompletionChoice(index=i, text=(echo.text if echo else "") + text, finish_reason=gen.finish_reason,
                                    logprobs=None if body.logprobs is None else _completion_logprobs(ctx, gen, echo, shift))
                   for i, (gen, text) in enumerate(zip(gens, texts))]
        return _json(ctx, gens[0], CompletionResponse(**_envelope(ctx, gens[0]), choices=choices, usage=_usage(gens)))

    @router.post("/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        messages = body.template_messages()
        _check_prompt_chars(limits, sum(len(m["content"]) for m in messages), "messages")
        prompt_text, prompt_ids = await asyncio.to_thread(_chat_prompt, ctx, messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        schema = body.response_format.output_schema() if body.response_format else None
        grammars = await _grammars(ctx, limits, schema, body.n)
        gens, ticket = _choices(ctx, admission, request, body, CHAT, prompt_ids, prompt_text, "messages", None,
                                logprobs, grammars=grammars)
        if body.stream:
            return _sse(ctx, gens, ticket, _chat_events(ctx, gens, body.include_usage))
        texts = await _run_unless_disconnected(ctx, request, gens, ticket)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=text), logprobs=_chat_logprobs(ctx, gen),
                              finish_reason=gen.finish_reason) for i, (gen, text) in enumerate(zip(gens, texts))]
        return _json(ctx, gens[0], ChatCompletionResponse(**_envelope(ctx, gens[0]), choices=choices,
                                                          usage=_usage(gens)))

    return router


def _check_model(ctx: ServingContext, model: str) -> None:
    if model != ctx.model:
        raise APIError(404, f"model {model!r} does not exist; this server serves {ctx.model!r}",
                       param="model", code="model_not_found")


def _check_prompt_chars(limits: RequestLimits, chars: int, field: str) -> None:
    try:
        limits.check_prompt_chars(chars, field)
    except ValueError as e:
        raise APIError(400, str(e), param=field, code="context_length_exceeded") from e


def _chat_prompt(ctx: ServingContext, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The templated prompt and its token ids (on a worker thread: Jinja and the tokenizer take CPU)."""
    try:
        text = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    return text, ctx.tokenizer.encode(text, add_special_tokens=False)


def _choices(ctx: ServingContext, admission: Admission, request: Request,
             body: CompletionRequest | ChatCompletionRequest, endpoint: str, prompt_ids: list[int],
             prompt_text: str | None, prompt_field: str, default_max_tokens: int | None, logprobs: int | None,
             prompt_logprobs: int | None = None, grammars: list[Grammar] | None = None,
             ) -> tuple[list[Generation], Ticket]:
    """One generation per choice (`n`), admitted together: the ticket holds their sequences and tokens.
    Choice i samples with seed + i, so each choice is reproducible on its own; they do not share the
    prompt's prefill (each sequence fills its own cache slot). With `grammars`, choice i decodes under
    the i-th."""
    first = _request_input(ctx, request, body, endpoint, prompt_ids, prompt_text, prompt_field, default_max_tokens,
                           logprobs, prompt_logprobs)
    limit = body.token_limit()
    tenant: TenantPolicy = request.state.tenant
    ticket = admission.reserve(tenant, body.n, len(prompt_ids), first.params.max_tokens,
                               limit[0] if limit else "max_tokens")
    inputs = [dataclasses.replace(first, request_id=f"{first.request_id}-{i}" if i else first.request_id,
                                  params=_choice_params(first.params, i), grammar=grammars[i] if grammars else None)
              for i in range(body.n)]
    return [Generation(ctx, r) for r in inputs], ticket


async def _grammars(ctx: ServingContext, limits: RequestLimits, schema: dict | None, n: int) -> list[Grammar] | None:
    """Each choice's grammar of `schema` (compiled once, and cached by the compiler), off the event loop."""
    if schema is None:
        return None
    assert ctx.grammars is not None
    try:
        limits.check_schema(schema)
        return await asyncio.to_thread(lambda: [ctx.grammars.json_schema(schema) for _ in range(n)])
    except ValueError as e:
        raise APIError(400, f"response_format: {e}", param="response_format") from e


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2 ** 63) % 2 ** 64 - 2 ** 63)  # stays int64


def _request_input(ctx: ServingContext, request: Request, body: CompletionRequest | ChatCompletionRequest,
                   endpoint: str, prompt_ids: list[int], prompt_text: str | None, prompt_field: str,
                   default_max_tokens: int | None, logprobs: int | None = None,
                   prompt_logprobs: int | None = None) -> RequestInput:
    """Check the prompt against the context and build the engine's parameters; 400 on any misfit."""
    try:
        ctx.engine.check_prompt(prompt_ids)
    except PromptTooLong as e:
        raise APIError(400, str(e), param=prompt_field, code="context_length_exceeded") from e
    except ValueError as e:
        raise APIError(400, str(e), param=prompt_field) from e
    room = ctx.engine.config.max_len - len(prompt_ids)
    limit = body.token_limit()
    if limit is not None and limit[1] > room:
        raise APIError(400, f"the context holds {ctx.engine.config.max_len} tokens; the prompt has {len(prompt_ids)}, "
                            f"so at most {room} can be generated, but {limit[0]} is {limit[1]}",
                       param=limit[0], code="context_length_exceeded")
    max_tokens = limit[1] if limit is not None else min(default_max_tokens or room, room)
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)
    return RequestInput(request_id=new_id("chatcmpl" if endpoint == CHAT else "cmpl"),
                        endpoint=endpoint, prompt_ids=prompt_ids, prompt_text=prompt_text, params=params,
                        stop=body.stop_strings, tenant=request.state.tenant.name,
                        suffix_cache=request.state.tenant.suffix_cache,
                        user=request.headers.get(SUBJECT_HEADER) or body.user)


class _Echo:
    """What `echo` puts before a completion: the prompt's text, and its tokens' offsets in it."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, prompt_ids: list[int]) -> None:
        self.ctx, self.prompt_ids = ctx, prompt_ids
        self.text = body.prompt if isinstance(body.prompt, str) else self._decoded[0]

    @functools.cached_property
    def _decoded(self) -> tuple[str, list[tuple[int, None, int]]]:
        # Token by token, so only when needed: token-id prompts, or log-probabilities with their offsets.
        return prompt_entries(self.ctx.tokenizer, self.prompt_ids, [None] * len(self.prompt_ids))

    def entries(self, gen: Generation) -> list[tuple[int, object, int]]:
        scored = gen.prompt_logprobs or [None] * len(self.prompt_ids)
        return [(offset, entry, token) for (offset, _, token), entry in zip(self._decoded[1], scored, strict=True)]


def _completion_logprobs(ctx: ServingContext, gen: Generation, echo: _Echo | None, shift: int,
                         with_prompt: bool = True) -> CompletionLogprobs:
    """The legacy format for the tokens sent since the last call (offsets past `shift` characters of
    echoed prompt), the prompt's own first when echoing."""
    entries = echo.entries(gen) if echo is not None and with_prompt else []
    entries += [(shift + offset, entry, entry.token_id) for offset, entry in gen.take_logprobs()]
    return completion_logprobs(ctx.tokenizer, entries)


def _chat_logprobs(ctx: ServingContext, gen: Generation) -> ChatLogprobs | None:
    if gen.req.params.logprobs is None:
        return None
    return chat_logprobs(ctx.tokenizer, [entry for _, entry in gen.take_logprobs()])


def _usage(gens: list[Generation]) -> Usage:
    """The prompt once (as OpenAI counts it), every choice's completion tokens, speculation pooled."""
    pooled = SpecStats.pooled(g.spec for g in gens if g.spec is not None)
    spec = None
    if pooled.drafts:
        spec = SpeculationUsage(drafts=pooled.drafts, draft_tokens=pooled.draft_tokens,
                                accepted_tokens=pooled.accepted_tokens, mean_accepted_length=pooled.mean_accepted_length)
    completion = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens=gens[0].prompt_tokens, completion_tokens=completion,
                 total_tokens=gens[0].prompt_tokens + completion, speculation=spec)


def _json(ctx: ServingContext, gen: Generation, payload: CompletionResponse | ChatCompletionResponse) -> Response:
    ctx.metrics.record_request(gen.req.endpoint, 200)
    return Response(payload.model_dump_json(), media_type="application/json")


# --------------------------------------------------------------------------------- running and streaming


async def _run_unless_disconnected(ctx: ServingContext, request: Request, gens: list[Generation],
                                   ticket: Ticket) -> list[str]:
    """Every choice's whole text; aborts the generations if the client hangs up first. The ticket is
    released however it ends."""
    try:
        return await _run(ctx, request, gens)
    finally:
        ticket.release(sum(g.completion_tokens for g in gens))


async def _run(ctx: ServingContext, request: Request, gens: list[Generation]) -> list[str]:
    gen = gens[0]

    async def collect(g: Generation) -> str:
        return "".join([piece async for piece in g.text()])

    work = asyncio.ensure_future(asyncio.gather(*(collect(g) for g in gens)))
    hangup = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        ctx.metrics.record_request(gen.req.endpoint, _DISCONNECTED)
        raise asyncio.CancelledError("client disconnected")
    try:
        return work.result()
    except QueueTimeout as e:
        ctx.metrics.limited.labels(reason="queue_timeout").inc()
        raise APIError(503, str(e), code="queue_timeout", kind="server_error", retry_after_s=1.0) from e
    except EngineFailed as e:
        raise APIError(500, str(e), kind="server_error") from e


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(ctx: ServingContext, gens: list[Generation], ticket: Ticket, events: AsyncIterator[str]) -> StreamingResponse:
    gen = gens[0]

    async def body() -> AsyncIterator[str]:
        finished = False
        try:
            async for event in events:
                yield f"data: {event}\n\n"
            finished = True
        except QueueTimeout as e:
            ctx.metrics.limited.labels(reason="queue_timeout").inc()
            yield f"data: {_error_event(APIError(503, str(e), code='queue_timeout', kind='server_error'))}\n\n"
            finished = True
        except EngineFailed as e:
            yield f"data: {_error_event(APIError(500, str(e), kind='server_error'))}\n\n"
            finished = True
        finally:
            ctx.metrics.record_request(gen.req.endpoint, 200 if finished else _DISCONNECTED)
        yield "data: [DONE]\n\n"

    async def end() -> None:
        await stream.aclose()
        ticket.release(sum(g.completion_tokens for g in gens))

    stream = body()
    return _Stream(end, stream, media_type="text/event-stream",
                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(error: APIError) -> str:
    return ErrorResponse(error=error.body).model_dump_json()


class _Stream(StreamingResponse):
    """A streamed response that runs `end` however it ends: finished, the client gone (Starlette cancels
    the send loop, which may leave the body parked at a `yield`), or a send that timed out (the edge's
    slow-reader bound raises out of it, where a background task would not run). Closing the body
    there aborts the engine request now rather than whenever the generator is garbage-collected."""

    def __init__(self, end: Callable[[], Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._end()


def _envelope(ctx: ServingContext, gen: Generation) -> dict[str, str | int]:
    """The fields around the choices, identical on every chunk of one response."""
    return {"id": gen.req.request_id, "created": now(), "model": ctx.model, "system_fingerprint": ctx.fingerprint}


async def _merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of every stream as they come. Leaving early closes them all (aborting their requests)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        async with aclosing(stream):
            try:
                async for item in stream:
                    await queue.put(item)
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put(e)
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not done:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _completion_events(ctx: ServingContext, gens: list[Generation], include_usage: bool,
                             echo: _Echo | None) -> AsyncIterator[str]:
    head, exclude = _envelope(ctx, gens[0]), None if include_usage else {"usage"}
    async for choice in _merged([_completion_choice_stream(ctx, g, i, echo) for i, g in enumerate(gens)]):
        yield CompletionResponse(**head, choices=[choice]).model_dump_json(exclude=exclude)
    if include_usage:
        yield CompletionResponse(**head, choices=[], usage=_usage(gens)).model_dump_json()


async def _completion_choice_stream(ctx: ServingContext, gen: Generation, index: int,
                                    echo: _Echo | None) -> AsyncIterator[CompletionChoice]:
    shift, wants_logprobs = len(echo.text) if echo else 0, gen.req.params.logprobs is not None

    def chunk(text: str, finish_reason: str | None = None, logprobs: CompletionLogprobs | None = None
              ) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    first = True
    async for piece in gen.text():
        text = (echo.text if echo and first else "") + piece
        yield chunk(text, None, _completion_logprobs(ctx, gen, echo, shift, first) if wants_logprobs else None)
        first = False
    if echo and first:  # nothing was generated (max_tokens 0): the prompt alone
        yield chunk(echo.text, None, _completion_logprobs(ctx, gen, echo, shift) if wants_logprobs else None)
    yield chunk("", gen.finish_reason, _completion_logprobs(ctx, gen, None, shift) if wants_logprobs else None)


async def _chat_events(ctx: ServingContext, gens: list[Generation], include_usage: bool) -> AsyncIterator[str]:
    head, exclude = _envelope(ctx, gens[0]), None if include_usage else {"usage"}
    async for choice in _merged([_chat_choice_stream(ctx, g, i) for i, g in enumerate(gens)]):
        yield ChatCompletionChunk(**head, choices=[choice]).model_dump_json(exclude=exclude)
    if include_usage:
        yield ChatCompletionChunk(**head, choices=[], usage=_usage(gens)).model_dump_json()


async def _chat_choice_stream(ctx: ServingContext, gen: Generation, index: int) -> AsyncIterator[ChatChunkChoice]:
    def chunk(delta: ChatDelta, finish_reason: str | None = None, logprobs: ChatLogprobs | None = None
              ) -> ChatChunkChoice:
        return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    yield chunk(ChatDelta(role="assistant", content=""))
    async for piece in gen.text():
        yield chunk(ChatDelta(content=piece), logprobs=_chat_logprobs(ctx, gen))
    yield chunk(ChatDelta(), gen.finish_reason, _chat_logprobs(ctx, gen))

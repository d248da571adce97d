"""The HTTP server: an OpenAI-compatible FastAPI app over one loaded model and its engine.

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE streaming, in
OpenAI's exact wire format), `/health` (liveness), `/ready` (engine thread alive), `/metrics`.
Every error a client can cause comes back as OpenAI's error JSON with a 4xx status naming the
field; validation errors are 400, not FastAPI's 422. A client that disconnects, streaming or not,
has its engine request aborted so its KV-cache slot is freed.

Every `/v1` route authenticates first: `Authorization: Bearer <key>` names the tenant through
the `TenantDirectory` (a key it does not know is a 401 `invalid_api_key`, before the body's
fields are validated; only a body that is not JSON at all is reported first, as a 400). Without
a tenants file every request is tenant `anonymous`, never captured, whatever key the client
sends (the openai client always sends one). The subject whose consent decides capture is the
`X-Specloop-User` header when present, else the body's `user` field: the header is what a
gateway in front of the application sets after authenticating the end user, so it is trusted
over what the application put in the body. `/health`, `/ready` and `/metrics` are open;
routers in `extra_routers` (the consent admin API) bring their own authentication.

The app owns the engine's thread: its lifespan starts the engine when the server starts and stops
it at shutdown, after uvicorn has let in-flight requests finish, then runs the `on_shutdown`
callbacks (flushing trace capture). Request orchestration lives in `serving.py`.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from consent.tenants import TenantDirectory
from engine.loaders.load import LoadedModel
from engine.runtime.llm_engine import LLMEngine, PromptTooLong
from engine.runtime.sequence import SamplingParams
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculationUsage,
    Usage,
    new_id,
    now,
)
from engine.server.serving import EngineFailed, FinishHook, Generation, RequestInput, ServingContext
from engine.server.settings import ServerSettings

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "completions", "chat.completions"  # endpoint names in metrics and traces
_ENDPOINTS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}
_OPENAI_DEFAULT_MAX_TOKENS = 16  # what OpenAI's legacy completions endpoint generates when unset
_DISCONNECTED = 499  # nginx's "client closed request", as the status label for aborted requests
SUBJECT_HEADER = "X-Specloop-User"


class APIError(Exception):
    """An error the client caused (or a 5xx we report), rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=kind, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status)


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
    closers, companions = tuple(on_shutdown), tuple(companions)
    ctx = ServingContext(engine=engine, tokenizer=loaded.tokenizer, metrics=metrics,
                         model=settings.served_model_name or loaded.name, fingerprint=loaded.fingerprint,
                         on_finish=on_finish, weights=loaded.weights, quantized_from=loaded.source_fingerprint)
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
    app.include_router(_openai_router(ctx), dependencies=[Depends(_authenticator(tenants))])
    for router in extra_routers:
        app.include_router(router)
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


# ------------------------------------------------------------------------------------------ tenants


def _authenticator(tenants: TenantDirectory) -> Callable[[Request], Awaitable[None]]:
    """A dependency that puts the caller's tenant name on `request.state.tenant`, or raises a 401."""

    async def authenticate(request: Request) -> None:
        tenant = tenants.resolve(_bearer_key(request.headers.get("authorization")))
        if tenant is None:
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` with a key "
                                "issued to your tenant", code="invalid_api_key", kind="authentication_error")
        request.state.tenant = tenant.name

    return authenticate


def _bearer_key(authorization: str | None) -> str | None:
    """The key of a `Bearer` header; any other scheme is returned whole, so it matches no key."""
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else authorization


# ------------------------------------------------------------------------------------------ OpenAI API


def _openai_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter(prefix="/v1")
    created = now()

    @router.get("/models")
    async def models() -> ModelList:
        card = ModelCard(id=ctx.model, created=created, fingerprint=ctx.fingerprint,
                         max_model_len=ctx.engine.config.max_len, drafter_version=ctx.engine.drafter_version,
                         weights=ctx.weights, quantized_from=ctx.quantized_from)
        return ModelList(data=[card])

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        if isinstance(body.prompt, str):
            prompt_ids, prompt_text = ctx.tokenizer.encode(body.prompt, add_special_tokens=True), body.prompt
        else:
            prompt_ids, prompt_text = list(body.prompt), None
        gen = Generation(ctx, _request_input(ctx, request, body, COMPLETIONS, prompt_ids, prompt_text, "prompt",
                                             _OPENAI_DEFAULT_MAX_TOKENS))
        if body.stream:
            return _sse(ctx, gen, _completion_events(ctx, gen, body.include_usage))
        text = await _run_unless_disconnected(ctx, request, gen)
        choice = CompletionChoice(text=text, finish_reason=gen.finish_reason)
        return _json(ctx, gen, CompletionResponse(**_envelope(ctx, gen), choices=[choice], usage=_usage(gen)))

    @router.post("/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(ctx, body.model)
        try:
            prompt_text = ctx.tokenizer.apply_chat_template(body.template_messages(), add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        prompt_ids = ctx.tokenizer.encode(prompt_text, add_special_tokens=False)
        gen = Generation(ctx, _request_input(ctx, request, body, CHAT, prompt_ids, prompt_text,
                                             "messages", None))
        if body.stream:
            return _sse(ctx, gen, _chat_events(ctx, gen, body.include_usage))
        text = await _run_unless_disconnected(ctx, request, gen)
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
        return _json(ctx, gen, ChatCompletionResponse(**_envelope(ctx, gen), choices=[choice], usage=_usage(gen)))

    return router


def _check_model(ctx: ServingContext, model: str) -> None:
    if model != ctx.model:
        raise APIError(404, f"model {model!r} does not exist; this server serves {ctx.model!r}",
                       param="model", code="model_not_found")


def _request_input(ctx: ServingContext, request: Request, body: CompletionRequest | ChatCompletionRequest,
                   endpoint: str, prompt_ids: list[int], prompt_text: str | None, prompt_field: str,
                   default_max_tokens: int | None) -> RequestInput:
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
                            top_k=body.top_k, seed=body.seed, ignore_eos=body.ignore_eos)
    return RequestInput(request_id=new_id("chatcmpl" if endpoint == CHAT else "cmpl"),
                        endpoint=endpoint, prompt_ids=prompt_ids, prompt_text=prompt_text, params=params,
                        stop=body.stop_strings, tenant=request.state.tenant,
                        user=request.headers.get(SUBJECT_HEADER) or body.user)


def _usage(gen: Generation) -> Usage:
    spec = None
    if gen.spec is not None and gen.spec.drafts:
        spec = SpeculationUsage(drafts=gen.spec.drafts, draft_tokens=gen.spec.draft_tokens,
                                accepted_tokens=gen.spec.accepted_tokens,
                                mean_accepted_length=gen.spec.mean_accepted_length)
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                 total_tokens=gen.prompt_tokens + gen.completion_tokens, speculation=spec)


def _json(ctx: ServingContext, gen: Generation, payload: CompletionResponse | ChatCompletionResponse) -> Response:
    ctx.metrics.record_request(gen.req.endpoint, 200)
    return Response(payload.model_dump_json(), media_type="application/json")


# --------------------------------------------------------------------------------- running and streaming


async def _run_unless_disconnected(ctx: ServingContext, request: Request, gen: Generation) -> str:
    """The whole completion text; aborts the generation if the client hangs up first."""

    async def collect() -> str:
        return "".join([piece async for piece in gen.text()])

    work = asyncio.ensure_future(collect())
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
    except EngineFailed as e:
        raise APIError(500, str(e), kind="server_error") from e


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(ctx: ServingContext, gen: Generation, events: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        finished = False
        try:
            async for event in events:
                yield f"data: {event}\n\n"
            finished = True
        except EngineFailed as e:
            yield f"data: {ErrorResponse(error=APIError(500, str(e), kind='server_error').body).model_dump_json()}\n\n"
            finished = True
        finally:
            ctx.metrics.record_request(gen.req.endpoint, 200 if finished else _DISCONNECTED)
        yield "data: [DONE]\n\n"

    # When the client disconnects Starlette cancels the send loop, which may leave `stream` parked at
    # a `yield`; closing it in the background task (run either way) aborts the engine request now
    # rather than whenever the generator is garbage-collected.
    stream = body()
    return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(stream.aclose),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _envelope(ctx: ServingContext, gen: Generation) -> dict[str, str | int]:
    """The fields around the choices, identical on every chunk of one response."""
    return {"id": gen.req.request_id, "created": now(), "model": ctx.model, "system_fingerprint": ctx.fingerprint}


async def _completion_events(ctx: ServingContext, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    head, exclude = _envelope(ctx, gen), None if include_usage else {"usage"}

    def chunk(text: str, finish_reason: str | None = None) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(**head, choices=[choice]).model_dump_json(exclude=exclude)

    async for piece in gen.text():
        yield chunk(piece)
    yield chunk("", gen.finish_reason)
    if include_usage:
        yield CompletionResponse(**head, choices=[], usage=_usage(gen)).model_dump_json()


async def _chat_events(ctx: ServingContext, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    head, exclude = _envelope(ctx, gen), None if include_usage else {"usage"}

    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return ChatCompletionChunk(**head, choices=[choice]).model_dump_json(exclude=exclude)

    yield chunk(ChatDelta(role="assistant", content=""))
    async for piece in gen.text():
        yield chunk(ChatDelta(content=piece))
    yield chunk(ChatDelta(), gen.finish_reason)
    if include_usage:
        yield ChatCompletionChunk(**head, choices=[], usage=_usage(gen)).model_dump_json()

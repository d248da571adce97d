"""`specloop serve`: load the model, start the engine, serve the OpenAI API with uvicorn.

Options override `SPECLOOP_*` environment variables, which override the defaults in
`engine/server/settings.py`. SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting, lets
in-flight requests finish (up to 30 s), then the app's lifespan stops the engine thread, and
uvicorn re-raises the signal so the exit status says how the process ended.

With `--kafka-bootstrap` (or `SPECLOOP_KAFKA_BOOTSTRAP`) the server captures consented requests as
traces on that broker and serves the consent admin API under `/admin`; the consent side reads its
own `SPECLOOP_*` settings (`consent/settings.py`: keys, registry, tenants file). The tenants file
(`SPECLOOP_TENANTS_FILE`) is honoured with or without capture.

This file only wires parts together; it holds no serving logic.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from specloop.engine.server.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import APIRouter, FastAPI

    from specloop.consent.settings import ConsentSettings
    from specloop.engine.loaders.load import LoadedModel
    from specloop.engine.runtime.llm_engine import LLMEngine
    from specloop.engine.server.drafter_follower import DrafterFollower
    from specloop.engine.server.metrics import ServerMetrics
    from specloop.engine.speculation.proposer import Proposer
    from specloop.engine.speculation.suffix_cache import SuffixCache

log = logging.getLogger(__name__)

_GRACEFUL_SHUTDOWN_S = 30


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default: 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: 8000)")] = None,
    model: Annotated[str | None, typer.Option(help="HF model directory or .gguf file (default: SmolLM2 GGUF)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id for clients (default: its name)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 or bfloat16 (default: bfloat16)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N (default: auto)")] = None,
    weights: Annotated[str | None, typer.Option(
        help="auto: the model's own format (gguf, nvfp4) where the CPU kernels read it, else dense; dense: as "
             "stored; gguf: serve a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors from their own blocks (CPU); or "
             "nvfp4: serve the projections from NVFP4 weights, quantized on load or read from an NVFP4 checkpoint "
             "(default: auto)")] = None,
    nvfp4_lm_head: Annotated[bool | None, typer.Option(
        "--nvfp4-lm-head/--no-nvfp4-lm-head", help="With --weights nvfp4, quantize the LM head too (default: off)")]
    = None,
    nvfp4_embedding: Annotated[bool | None, typer.Option(
        "--nvfp4-embedding/--no-nvfp4-embedding",
        help="With --weights nvfp4, hold the token embedding in NVFP4 too, quantized on load (default: off)")] = None,
    num_slots: Annotated[int | None, typer.Option(help="Concurrent sequences (KV-cache slots) (default: 8)")] = None,
    max_len: Annotated[int | None, typer.Option(help="Context length per sequence (default: 2048)")] = None,
    drafter: Annotated[Path | None, typer.Option(help="DFlash drafter artifact directory")] = None,
    registry: Annotated[str | None, typer.Option(
        help="MLflow tracking URI (sqlite:///... or http://...): draft with the served model's champion drafter "
             "there, swapped live when the alias moves")] = None,
    registry_poll_s: Annotated[float | None, typer.Option(help="Seconds between looks at the alias (default: 30)")]
    = None,
    proposer: Annotated[str | None, typer.Option(help="auto, ngram, dflash or combined (default: auto)")] = None,
    block_size: Annotated[int | None, typer.Option(
        help="Verify block length (default: the drafter's; n-gram 4)")] = None,
    speculate: Annotated[bool | None, typer.Option("--speculate/--no-speculate",
                                                   help="Use the drafter when one is loaded (default: on)")] = None,
    kafka_bootstrap: Annotated[str | None, typer.Option(help="Kafka host:port[,...]; capture traces there")] = None,
    kafka_topic: Annotated[str | None, typer.Option(help="Trace topic (default: traces)")] = None,
    kafka_config: Annotated[str | None, typer.Option(help='JSON of extra KafkaProducer arguments, e.g. '
                                                          '{"security_protocol": "SASL_SSL"}')] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    overrides = {k: v for k, v in locals().items() if v is not None}
    settings = load_settings(overrides)
    run_server(settings)


def load_settings(overrides: dict[str, Any]) -> ServerSettings:
    try:
        return ServerSettings(**overrides)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise typer.BadParameter(problems) from e


def run_server(settings: ServerSettings) -> None:
    """Load the model and serve until a signal arrives (the app starts and stops the engine)."""
    app, loaded = build_server(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                                           timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    log.info("serving %s (fingerprint %s) on http://%s:%d", loaded.name, loaded.fingerprint, settings.host,
             settings.port)
    server.run()


def build_server(settings: ServerSettings) -> tuple["FastAPI", "LoadedModel"]:
    """The app `specloop serve` runs: model, engine, tenants and, with a broker, trace capture."""
    # Imported here so that `specloop --help` and other packages' commands skip FastAPI and loaders.
    from specloop.engine.loaders.load import load_for_inference
    from specloop.engine.runtime.llm_engine import LLMEngine
    from specloop.engine.runtime.torch_thread import TorchThread
    from specloop.engine.speculation.suffix_cache import SuffixCache

    consent = _consent_settings()
    suffix_cache = SuffixCache(settings.suffix_cache_tokens)  # one for the server's life: swaps keep it
    device, dtype = settings.torch_device(), settings.torch_dtype()
    log.info("loading %s as %s on %s", settings.model or "the default SmolLM2 GGUF", settings.dtype, device)

    def load() -> tuple["LoadedModel", "LLMEngine"]:
        loaded = load_for_inference(settings.model, dtype, device, settings.weight_format())
        proposer, version = _proposer(settings, loaded, suffix_cache)
        engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids, proposer, thread,
                           drafter_version=version)
        return loaded, engine

    # The model, its KV cache and the loop all on one thread: see engine/runtime/torch_thread.py (98 vs 57 tok/s).
    thread = TorchThread()
    loaded, engine = thread.run(load)
    return serving_app(settings, loaded, engine, consent, suffix_cache), loaded


def serving_app(settings: ServerSettings, loaded: "LoadedModel", engine: "LLMEngine",
                consent: "ConsentSettings", suffix_cache: "SuffixCache | None" = None) -> "FastAPI":
    """The app over a loaded model and its engine: tenants from `consent`, capture when a broker is set;
    the registry follower's suffix proposers draw on `suffix_cache` (None: each request's own context)."""
    from specloop.consent.tenants import TenantDirectory
    from specloop.engine.server.api import build_app
    from specloop.engine.server.metrics import ServerMetrics

    try:
        tenants = TenantDirectory.load(consent.tenants_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="SPECLOOP_TENANTS_FILE") from e
    metrics = ServerMetrics(engine.stats)
    routers, companions = [], []
    if settings.registry is not None:
        follower = _follower(settings, loaded, engine, metrics, suffix_cache)
        from specloop.engine.server.drafter_admin import build_drafter_admin_router

        routers.append(_under_admin(build_drafter_admin_router(follower, consent.resolve().admin_token)))
        companions.append((follower.start, follower.stop))
    if settings.kafka_bootstrap is None:
        log.info("trace capture off (no --kafka-bootstrap)")
        return build_app(loaded, engine, settings, extra_routers=routers, tenants=tenants, metrics=metrics,
                         companions=companions)
    from specloop.engine.server.trace_hook import open_capture

    capture = open_capture(settings, consent.resolve(), tenants, metrics.registry, loaded.tokenizer.decode,
                           loaded.tokenizer.encode)
    log.info("capturing consented traces to %s topic %s", settings.kafka_bootstrap, settings.kafka_topic)
    return build_app(loaded, engine, settings, extra_routers=[capture.admin_router, *routers], on_finish=capture.hook,
                     tenants=tenants, metrics=metrics, on_shutdown=[lambda: capture.close(settings.capture_flush_s)],
                     companions=companions)


def _under_admin(router: "APIRouter") -> "APIRouter":
    from fastapi import APIRouter

    admin = APIRouter(prefix="/admin")
    admin.include_router(router)
    return admin


def _follower(settings: ServerSettings, loaded: "LoadedModel", engine: "LLMEngine", metrics: "ServerMetrics",
              suffix_cache: "SuffixCache | None") -> "DrafterFollower":
    """The thread that keeps the engine on the registry's champion drafter for the served model."""
    from specloop.engine.server.drafter_follower import DrafterFollower, probe_text_tokens
    from specloop.engine.speculation.canary import probe_prompts
    from specloop.engine.speculation.kinds import LEARNED_KINDS
    from specloop.storage.registry import DrafterRegistry

    kind = settings.proposer_kind()
    assert kind in LEARNED_KINDS, kind  # settings refuse a registry with a lookup alone
    log.info("following the champion drafter of %s in %s every %.0f s", loaded.fingerprint, settings.registry,
             settings.registry_poll_s)
    return DrafterFollower(DrafterRegistry(settings.registry), engine, loaded.model, loaded.fingerprint, kind,
                           probe_text_tokens(loaded.tokenizer.encode), settings.drafter_cache_dir,
                           settings.registry_poll_s, settings.block_size, metrics.record_swap,
                           probe_prompts(loaded.tokenizer), metrics.record_canary, suffix_cache)


def _consent_settings() -> "ConsentSettings":
    from specloop.consent.settings import ConsentSettings

    try:
        return ConsentSettings()
    except ValidationError as e:
        problems = "; ".join(f"SPECLOOP_{str(err['loc'][0]).upper()}: {err['msg']}" for err in e.errors())
        raise typer.BadParameter(problems) from e


def _proposer(settings: ServerSettings, loaded: "LoadedModel",
              suffix_cache: "SuffixCache") -> tuple["Proposer | None", str | None]:
    """What drafts at start-up, and its drafter version; refuses a drafter trained for another model.

    Following a registry, the engine starts with the kind's lookup alone (n-gram lookup for combined,
    suffix decoding for dflash+suffix) or nothing (dflash), and the follower swaps the champion in
    once it has checked it.
    """
    from specloop.engine.speculation.build import build_proposer
    from specloop.engine.speculation.drafter_artifact import load_drafter
    from specloop.engine.speculation.kinds import LEARNED_KINDS, lookup_kind

    kind = settings.proposer_kind()
    if kind is None:
        return None, None
    if kind not in LEARNED_KINDS or settings.registry is not None:
        lookup = lookup_kind(kind)
        if lookup is None:
            return None, None
        return build_proposer(lookup, loaded.model, block_size=settings.block_size, suffix_cache=suffix_cache,
                              max_block_size=settings.engine_config().max_block_size), None
    artifact = load_drafter(settings.drafter, loaded.fingerprint, loaded.model.device, loaded.model.dtype)
    proposer = build_proposer(kind, loaded.model, artifact.drafter, settings.block_size, suffix_cache,
                              settings.engine_config().max_block_size)
    log.info("drafter %s (block size %d, %s)", settings.drafter, proposer.block_size, kind)
    return proposer, settings.drafter.name

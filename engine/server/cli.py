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

from engine.server.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from consent.settings import ConsentSettings
    from engine.loaders.load import LoadedModel
    from engine.runtime.llm_engine import LLMEngine
    from engine.speculation.proposer import Proposer

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
    num_slots: Annotated[int | None, typer.Option(help="Concurrent sequences (KV-cache slots) (default: 8)")] = None,
    max_len: Annotated[int | None, typer.Option(help="Context length per sequence (default: 2048)")] = None,
    drafter: Annotated[Path | None, typer.Option(help="DFlash drafter artifact directory")] = None,
    proposer: Annotated[str | None, typer.Option(help="auto, ngram, dflash or combined (default: auto)")] = None,
    block_size: Annotated[int | None, typer.Option(help="Verify block length (default: the drafter's; n-gram 4)")] = None,
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
    from engine.loaders.load import load_for_inference
    from engine.runtime.llm_engine import LLMEngine
    from engine.runtime.torch_thread import TorchThread

    consent = _consent_settings()
    device, dtype = settings.torch_device(), settings.torch_dtype()
    log.info("loading %s as %s on %s", settings.model or "the default SmolLM2 GGUF", settings.dtype, device)

    def load() -> tuple["LoadedModel", "LLMEngine"]:
        loaded = load_for_inference(settings.model, dtype, device)
        engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids,
                           _proposer(settings, loaded), thread)
        return loaded, engine

    # The model, its KV cache and the loop all on one thread: see engine/runtime/torch_thread.py (98 vs 57 tok/s).
    thread = TorchThread()
    loaded, engine = thread.run(load)
    return serving_app(settings, loaded, engine, consent), loaded


def serving_app(settings: ServerSettings, loaded: "LoadedModel", engine: "LLMEngine",
                consent: "ConsentSettings") -> "FastAPI":
    """The app over a loaded model and its engine: tenants from `consent`, capture when a broker is set."""
    from consent.tenants import TenantDirectory
    from engine.server.api import build_app
    from engine.server.metrics import ServerMetrics

    try:
        tenants = TenantDirectory.load(consent.tenants_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="SPECLOOP_TENANTS_FILE") from e
    metrics = ServerMetrics(engine.stats)
    if settings.kafka_bootstrap is None:
        log.info("trace capture off (no --kafka-bootstrap)")
        return build_app(loaded, engine, settings, tenants=tenants, metrics=metrics)
    from engine.server.trace_hook import open_capture

    capture = open_capture(settings, consent.resolve(), tenants, metrics.registry, loaded.tokenizer.decode)
    log.info("capturing consented traces to %s topic %s", settings.kafka_bootstrap, settings.kafka_topic)
    return build_app(loaded, engine, settings, extra_routers=[capture.admin_router], on_finish=capture.hook,
                     tenants=tenants, metrics=metrics, on_shutdown=[lambda: capture.close(settings.capture_flush_s)])


def _consent_settings() -> "ConsentSettings":
    from consent.settings import ConsentSettings

    try:
        return ConsentSettings()
    except ValidationError as e:
        problems = "; ".join(f"SPECLOOP_{str(err['loc'][0]).upper()}: {err['msg']}" for err in e.errors())
        raise typer.BadParameter(problems) from e


def _proposer(settings: ServerSettings, loaded: "LoadedModel") -> "Proposer | None":
    """The drafter `settings.proposer` asks for; refuses a DFlash drafter trained for another model."""
    from engine.speculation.combined import CombinedProposer
    from engine.speculation.dflash_proposer import DFlashProposer
    from engine.speculation.drafter_artifact import load_drafter
    from engine.speculation.ngram import NgramProposer

    kind = settings.proposer
    if kind == "auto":
        kind = "dflash" if settings.drafter else None
    if kind is None:
        return None
    if kind == "ngram":
        # Block 4: on held-out evals prompts (bf16, batch 1) n-gram at block 3/4/8 ran 1.13x/1.12x/0.87x
        # plain decoding; longer blocks draft more than gets accepted (README "Speculative decoding").
        return NgramProposer(block_size=settings.block_size or 4)
    artifact = load_drafter(settings.drafter, loaded.fingerprint, loaded.model.device, loaded.model.dtype)
    dflash = DFlashProposer(artifact.drafter, loaded.model, settings.block_size)
    log.info("drafter %s (block size %d, %s)", settings.drafter, dflash.block_size, kind)
    return dflash if kind == "dflash" else CombinedProposer(dflash, NgramProposer(block_size=dflash.block_size))

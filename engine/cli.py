"""`specloop serve`: load the model, start the engine, serve the OpenAI API with uvicorn.

Options override `SPECLOOP_*` environment variables, which override the defaults in
`engine/settings.py`. SIGINT/SIGTERM shut down gracefully: uvicorn stops accepting, lets
in-flight requests finish (up to 30 s), then the engine thread is stopped.

This file only wires parts together; it holds no serving logic.
"""

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from engine.settings import ServerSettings

if TYPE_CHECKING:
    from engine.dflash_proposer import DFlashProposer
    from engine.loading import LoadedModel

log = logging.getLogger(__name__)

_GRACEFUL_SHUTDOWN_S = 30


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind (default: 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: 8000)")] = None,
    model: Annotated[str | None, typer.Option(help="HF model directory or .gguf file (default: SmolLM2 GGUF)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id clients send (default: the model's name)")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 or bfloat16 (default: bfloat16)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N (default: auto)")] = None,
    num_slots: Annotated[int | None, typer.Option(help="Concurrent sequences (KV-cache slots) (default: 8)")] = None,
    max_len: Annotated[int | None, typer.Option(help="Context length per sequence (default: 2048)")] = None,
    drafter: Annotated[Path | None, typer.Option(help="DFlash drafter artifact directory")] = None,
    speculate: Annotated[bool | None, typer.Option("--speculate/--no-speculate",
                                                   help="Use the drafter when one is loaded (default: on)")] = None,
    log_level: Annotated[str | None, typer.Option(help="critical, error, warning, info, debug")] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    overrides = {k: v for k, v in locals().items() if v is not None}
    settings = _settings(overrides)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(settings)


def _settings(overrides: dict[str, Any]) -> ServerSettings:
    try:
        return ServerSettings(**overrides)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise typer.BadParameter(problems) from e


def run_server(settings: ServerSettings) -> None:
    """Load, serve until a signal arrives, then stop the engine."""
    # Imported here so that `specloop --help` and other packages' commands skip FastAPI and loaders.
    from engine.api import build_app
    from engine.llm_engine import LLMEngine
    from engine.loading import load_model

    device, dtype = settings.torch_device(), settings.torch_dtype()
    log.info("loading %s as %s on %s", settings.model or "the default SmolLM2 GGUF", settings.dtype, device)
    loaded = load_model(settings.model, dtype, device)
    proposer = _proposer(settings, loaded) if settings.drafter else None
    engine = LLMEngine(loaded.model, settings.engine_config(), loaded.tokenizer.eos_token_ids, proposer)
    app = build_app(loaded, engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                           timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    log.info("serving %s (fingerprint %s) on http://%s:%d", loaded.name, loaded.fingerprint, settings.host,
             settings.port)
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()


def _proposer(settings: ServerSettings, loaded: "LoadedModel") -> "DFlashProposer":
    """The DFlash proposer for `settings.drafter`; refuses a drafter trained for another model."""
    from engine.dflash_proposer import DFlashProposer
    from engine.drafter_artifact import load_drafter

    artifact = load_drafter(settings.drafter, loaded.fingerprint, loaded.model.device, loaded.model.dtype)
    log.info("drafter %s (block size %d)", settings.drafter, artifact.drafter.config.block_size)
    return DFlashProposer(artifact.drafter, loaded.model)

"""The daemon's HTTP side: `/health` (200 while the scheduler runs, 503 otherwise), `/metrics`
(Prometheus) and `/status` (what `specloop status` prints), on a FastAPI app whose lifespan starts
and stops the daemon, so uvicorn's SIGTERM handling is the daemon's graceful shutdown.

Not here: the daemon (`service.py`).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specloop.daemon.retrain.service import RetrainDaemon
from specloop.daemon.retrain.status import status
from specloop.storage.registry import RegistryUnavailable


def daemon_app(daemon: RetrainDaemon) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        daemon.start()
        try:
            yield
        finally:
            await run_in_threadpool(daemon.shutdown)  # waits for a run to stop: not on the event loop

    app = FastAPI(title="specloop daemon", lifespan=lifespan)

    @app.get("/health")
    def health() -> JSONResponse:
        ok = daemon.scheduler.running and not daemon.stop.is_set()
        body = {"status": "ok" if ok else "stopping", "base_model": daemon.base_model,
                "run_in_progress": daemon.current_run,
                "next_tick": None if daemon.next_tick() is None else daemon.next_tick().isoformat(timespec="seconds")}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(daemon.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    def current_status() -> JSONResponse:
        try:
            return JSONResponse(status(daemon.db, daemon.loop.registry, daemon.base_model))
        except RegistryUnavailable as e:
            body = {**status(daemon.db, None, daemon.base_model), "registry_error": str(e)}
            return JSONResponse(body, status_code=503)

    return app

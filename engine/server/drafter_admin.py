"""`POST /admin/drafter/reload`: look at the registry's `champion` alias now, instead of at the next poll.

Authenticated like the consent admin API (the admin token as a bearer token: 401 without one, 403
with a wrong one) and answered in the OpenAI error shape. The body is optional and, when given,
must be an empty JSON object: anything else is a 400 naming what is wrong. The answer is what the
look did (`engine/server/drafter_follower.py`, `CheckResult`): `swapped`, `unchanged`, `refused`
(with the reason), `benched` (suffix decoding alone drafts: the daemon found the champion short of
its margin over it), `no_champion` or `unavailable` (the registry could not be reached; 503).
"""

import dataclasses
from typing import Any

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from specloop.consent.admin_api import admin_route_class
from specloop.engine.server.drafter_follower import DrafterFollower


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


def build_drafter_admin_router(follower: DrafterFollower, admin_token: str) -> APIRouter:
    """The router to mount under `/admin`."""
    router = APIRouter(route_class=admin_route_class(admin_token), tags=["drafter admin"])

    @router.post("/drafter/reload")
    async def reload(body: ReloadBody | None = None) -> Any:
        # A check may download a version and wait for the engine to swap: off the event loop.
        result = await run_in_threadpool(follower.check)
        status = 503 if result.result == "unavailable" else 200
        return JSONResponse(dataclasses.asdict(result), status_code=status)

    return router

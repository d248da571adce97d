"""The consent admin HTTP API: grant, revoke (optionally with erasure) and list, as a FastAPI router.

The engine mounts it with `app.include_router(build_admin_router(...), prefix="/admin")`. Every
route requires `Authorization: Bearer <admin token>`; the check runs before the body is read, so an
unauthenticated caller learns nothing from validation errors. The deployment's admin token acts for
every tenant; a tenant's own admin token (`admin_token_sha256` in the tenants file) acts for that
tenant only: another tenant named in the body or query is refused with 403, and a listing without
a tenant lists its own. Errors use the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`: 401 without a token, 403 with a wrong one, 400
naming the field for a bad body (FastAPI's default would be a 422 in its own shape). Raw user ids are
accepted only in request bodies, never in URLs, which end up in access logs. This module holds no
consent logic; that is `specloop.consent.service`.
"""

import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AwareDatetime, BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from specloop.consent.erasure import TraceEraser
from specloop.consent.registry import ConsentRecord, ConsentRegistry, InvalidField
from specloop.consent.service import ConsentService, record_fields
from specloop.consent.settings import ConsentConfig
from specloop.consent.tenants import TenantDirectory


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GrantBody(_Body):
    tenant: str
    user: str | None = None
    subject: str | None = None
    purpose: str | None = None
    policy_version: str | None = None
    expires_at: AwareDatetime | None = None
    source: str = "admin_api"


class RevokeBody(_Body):
    tenant: str
    user: str | None = None
    subject: str | None = None
    purpose: str | None = None
    erase: bool = False


class QueryBody(_Body):
    tenant: str | None = None
    user: str | None = None
    subject: str | None = None
    purpose: str | None = None


def error_response(status: int, message: str, param: str | None, code: str) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _AdminRoute(APIRoute):
    """A route that authenticates first and renders errors in the OpenAI shape."""

    admin_token: bytes = b""
    tenant_tokens: TenantDirectory | None = None  # tenant-scoped admin tokens are accepted when set

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            refused = self._refuse(request)
            if refused is not None:
                return refused
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _validation_error(exc)
            except HTTPException as exc:  # FastAPI's own, e.g. a body that is not UTF-8 at all
                return error_response(exc.status_code, str(exc.detail), None, "invalid_body")
            except InvalidField as exc:
                return error_response(400, str(exc), exc.field, "invalid_value")
            except OutOfScope as exc:
                return error_response(403, str(exc), "tenant", "admin_token_out_of_scope")
            except OSError as exc:  # the traces root is missing: consent is revoked, the erasure audited failed
                return error_response(500, f"erasure failed: {exc}", None, "erasure_failed")

        return route

    def _refuse(self, request: Request) -> JSONResponse | None:
        """None when the bearer token is admitted, with `request.state.admin_scope` set (None: every
        tenant; else the one tenant the token belongs to)."""
        assert self.admin_token, "build the router's routes with admin_route_class"
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return error_response(401, "missing admin bearer token", None, "missing_admin_token")
        if hmac.compare_digest(token.strip().encode(), self.admin_token):
            request.state.admin_scope = None
            return None
        tenant = None if self.tenant_tokens is None else self.tenant_tokens.admin_scope(token.strip())
        if tenant is None:
            return error_response(403, "invalid admin token", None, "invalid_admin_token")
        request.state.admin_scope = tenant
        return None


class OutOfScope(Exception):
    """A tenant's admin token named another tenant (403)."""


def admin_route_class(admin_token: str, tenant_tokens: TenantDirectory | None = None) -> type[APIRoute]:
    """A route class for every admin router (consent's here, the engine's drafter reload): routes that
    check `Authorization: Bearer <admin_token>` before anything else and answer errors in the OpenAI shape;
    with `tenant_tokens`, a tenant's own admin token is admitted too, scoped to that tenant."""
    if not admin_token:
        raise ValueError("admin_token must not be empty")
    return type("AdminRoute", (_AdminRoute,), {"admin_token": admin_token.encode(), "tenant_tokens": tenant_tokens})


def scoped(request: Request, tenant: str | None) -> str | None:
    """The tenant a request may act on: `tenant` itself for the deployment's token; for a tenant's
    token, its own tenant (when `tenant` is None or names it), else OutOfScope."""
    scope = request.state.admin_scope
    if scope is None or tenant in (None, scope):
        return tenant if scope is None else scope
    raise OutOfScope(f"this admin token acts for tenant {scope!r} only, not {tenant!r}")


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "decode error")
        return error_response(400, f"body is not valid JSON: {reason}", None, "invalid_json")
    loc = [str(p) for p in first["loc"] if p not in ("body", "query")]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return error_response(400, message, param, "invalid_value")


def build_admin_router(
    registry: ConsentRegistry, config: ConsentConfig, tenants: TenantDirectory, erase_traces: TraceEraser | None = None
) -> APIRouter:
    """Routes `POST /consents`, `POST /consents/revoke`, `GET /consents`, `POST /consents/query`;
    revoking with `erase` needs `erase_traces` (`consent/erasure.py`)."""
    service = ConsentService(registry, config, tenants, erase_traces)
    router = APIRouter(route_class=admin_route_class(config.admin_token, tenants), tags=["consent admin"])

    def actor(request: Request) -> str:
        return f"admin_api:{request.client.host if request.client else 'unknown'}"

    @router.post("/consents", status_code=201)
    def grant(body: GrantBody, request: Request) -> dict[str, Any]:
        record = service.grant(scoped(request, body.tenant), body.user, body.subject, body.purpose,
                               body.policy_version, body.expires_at, body.source, actor(request))
        return record_fields(record)

    @router.post("/consents/revoke")
    def revoke(body: RevokeBody, request: Request) -> dict[str, Any]:
        outcome = service.revoke(scoped(request, body.tenant), body.user, body.subject, body.purpose, body.erase,
                                 actor(request))
        return {"revoked": [record_fields(r) for r in outcome.revoked], "erasure": outcome.erasure}

    @router.get("/consents")
    def list_consents(
        request: Request, tenant: str | None = None, subject: str | None = None, purpose: str | None = None
    ) -> dict[str, Any]:
        return _listing(service.list(scoped(request, tenant), None, subject, purpose))

    @router.post("/consents/query")
    def query(body: QueryBody, request: Request) -> dict[str, Any]:
        return _listing(service.list(scoped(request, body.tenant), body.user, body.subject, body.purpose))

    return router


def _listing(records: list[ConsentRecord]) -> dict[str, Any]:
    return {"object": "list", "data": [record_fields(r) for r in records]}

"""`APIError`: an error for the client, rendered as OpenAI's error JSON with its HTTP status.

Raised by the routes (`api.py`) and answered directly by the layer in front of them (`edge.py`), so
both speak the same shape: `{"error": {"message", "type", "param", "code"}}`, plus `Retry-After` on
a 429 or 503 that is worth retrying.
"""

import math

from fastapi.responses import JSONResponse

from specloop.engine.server.protocol import ErrorBody, ErrorResponse


class APIError(Exception):
    """An error the client caused (or a 5xx we report), rendered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, type=kind, param=param, code=code)
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        headers = None if self.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), status_code=self.status, headers=headers)


def rate_limited(message: str, kind: str, retry_after_s: float) -> APIError:
    """OpenAI's 429: `kind` is what ran out ("requests" or "tokens")."""
    return APIError(429, message, code="rate_limit_exceeded", kind=kind, retry_after_s=retry_after_s)

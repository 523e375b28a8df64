"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    408: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client with HTTP ``status``.

    ``param`` names the offending request field (dotted path) where there is one;
    ``headers`` are added to the response (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

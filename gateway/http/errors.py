"""Errors in OpenAI's format, ``{"error": {"message", "type", "param", "code"}}``, in
Anthropic's, ``{"type": "error", "error": {"type", "message"}}``, or in Ollama's,
``{"error": "message"}`` (each route's, as :func:`gateway.routes.table.error_style` names it)."""

from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          408: "invalid_request_error", 415: "invalid_request_error", 421: "invalid_request_error",
          429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


# Anthropic's error types by status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 421: "invalid_request_error",
                    429: "rate_limit_error", 431: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}


def context_too_long(prompt: int, limit: int, param: str = "messages") -> APIError:
    """The 400 for a prompt of ``prompt`` tokens over a limit of ``limit``, in the words
    clients recognise to compact or truncate: OpenAI's (``context_length_exceeded``,
    matched by litellm's ``ContextWindowExceededError``) and Anthropic's (``prompt is too
    long: N tokens > M maximum``)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your messages resulted "
                    f"in {prompt} tokens. Please reduce the length of the messages.", param=param,
                    code="context_length_exceeded",
                    anthropic_message=f"prompt is too long: {prompt} tokens > {limit} maximum")


class APIError(Exception):
    """An error answered to the client with HTTP ``status``.

    ``param`` names the offending request field (dotted path) where there is one;
    ``headers`` are added to the response (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, anthropic_message: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.anthropic_message = anthropic_message  # the words Anthropic's API uses, where clients match them

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"), "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict:
        message = self.anthropic_message or (self.message if self.param is None else f"{self.param}: {self.message}")
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": message}}

    def ollama_body(self) -> dict:
        """Ollama's shape: ``{"error": "message"}``."""
        return {"error": self.message}

    def response(self, style: str = "openai") -> JSONResponse:
        """The JSON answer in ``style`` (``openai``, ``anthropic`` or ``ollama``)."""
        body = {"anthropic": self.anthropic_body, "ollama": self.ollama_body}.get(style, self.body)()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

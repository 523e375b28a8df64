"""The outermost layer of the app (inside CORS): header limits, the Host allow-list, the
metrics key, errors in each route's shape, rate-limit headers, per-request metrics and the
request log."""

from __future__ import annotations

import hmac
import logging
import os
import time
from typing import Callable, Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http.errors import APIError
from gateway.http.hosts import HostPolicy

log = logging.getLogger("mlx_gateway.app")

MAX_HEADERS = 100
METRICS_KEY_ENV = "MLX_GATEWAY_METRICS_KEY"


def metrics_key(flag: Optional[str]) -> Optional[str]:
    """The key ``GET /metrics`` requires: ``flag`` (``--metrics-key``), else the
    ``MLX_GATEWAY_METRICS_KEY`` environment variable; None (open) when neither is set."""
    return flag or os.environ.get(METRICS_KEY_ENV) or None


class GatewayMiddleware:
    """Wraps every HTTP request.

    * Refuses requests with more than :data:`MAX_HEADERS` headers or more than
      ``config.max_header_bytes`` of them with 431, before any route runs.
    * Then refuses a ``Host`` header outside the allow-list with 421
      (:class:`gateway.http.hosts.HostPolicy`: localhost names, IP addresses, the bound
      ``--host`` and ``config.allowed_hosts``).
    * With a metrics key (:func:`metrics_key`), answers ``/metrics`` without
      ``Authorization: Bearer <key>`` with 401 and ``WWW-Authenticate: Bearer``.
    * Answers :class:`APIError` (and any other exception, as 500) in the path's error
      shape (``error_style``).
    * Adds the tenant's ``x-ratelimit-*`` headers to answers of admitted requests.
    * Runs the request's ``on_close`` callables once the answer (or stream) ends: they
      release its rate-limit ticket and the model it holds.
    * Counts answers by tenant, model, endpoint and status (successful scrapes and health
      checks excepted), through ``count``, and emits the request record.

    Routes leave ``tenant`` (a Tenant), ``ticket`` and ``record`` in ``request.state``, and
    append to its ``on_close`` list.

    Args:
        app: the app inside.
        hosts: the Host allow-list.
        max_header_bytes: the most bytes of request headers.
        metrics_key: the key ``/metrics`` requires (None: open).
        count: ``count(tenant, model, endpoint, status)`` for each answer counted.
        on_error: ``on_error(tenant, error)`` for each :class:`APIError` answered.
        error_style: ``error_style(path)``, the shape of a path's errors (``openai`` or
            ``anthropic``: :meth:`APIError.response`).
        endpoint: ``endpoint(path)``, a path's ``endpoint`` label (one per route).
    """

    # Scrapes and health checks are not client requests: counted only when they fail.
    UNCOUNTED = {"/metrics", "/health"}

    def __init__(self, app: ASGIApp, hosts: HostPolicy, max_header_bytes: int, metrics_key: Optional[str],
                 count: Callable[[str, str, str, str], None],
                 on_error: Callable[[str, APIError], None] = lambda tenant, error: None,
                 error_style: Callable[[str], str] = lambda path: "openai",
                 endpoint: Callable[[str], str] = lambda path: "other") -> None:
        self.app = app
        self.hosts = hosts
        self.max_header_bytes = max_header_bytes
        self.metrics_key = metrics_key
        self.count = count
        self.error_style = error_style
        self.endpoint = endpoint
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        local = scope.setdefault("state", {})
        local["on_close"] = []
        status = {"code": 500, "started": False}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                ticket = local.get("ticket")
                if ticket is not None and ticket.headers:
                    present = {k.lower() for k, _ in message.get("headers", [])}
                    extra = [(k.encode(), v.encode()) for k, v in ticket.headers.items() if k.encode() not in present]
                    message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)
            if message["type"] == "http.response.body":
                record = local.get("record")
                if record is not None and record.stream and "first_token" in record.marks:
                    record.marks.setdefault("first_write", time.monotonic())  # the first token's write

        try:
            self._check_headers(scope)
            self.hosts.check(scope.get("headers", []))
            if scope.get("path") == "/metrics":
                self._check_metrics_key(scope)
            await self.app(scope, receive, send_wrapper)
        except APIError as e:
            status["code"] = e.status
            tenant = local.get("tenant")
            self.on_error(tenant.name if tenant is not None else "unauthenticated", e)
            if not status["started"]:
                await e.response(self.error_style(scope.get("path", "")))(scope, receive, send_wrapper)
        except Exception as e:
            log.exception("unhandled error on %s", scope.get("path"))
            status["code"] = 500
            if not status["started"]:
                error = APIError(500, f"internal error: {type(e).__name__}")
                await error.response(self.error_style(scope.get("path", "")))(scope, receive, send)
        finally:
            for close in local["on_close"]:
                try:
                    close()
                except Exception:
                    log.exception("closing a request on %s failed", scope.get("path"))
            self._account(scope, local, status["code"], time.monotonic() - start)

    def _check_headers(self, scope: Scope) -> None:
        headers = scope.get("headers", [])
        size = sum(len(k) + len(v) for k, v in headers)
        limit = self.max_header_bytes
        if len(headers) > MAX_HEADERS or size > limit:
            raise APIError(431, f"request headers over the limit ({MAX_HEADERS} headers, {limit} bytes)",
                           code="headers_too_large")

    def _check_metrics_key(self, scope: Scope) -> None:
        """Raises:
            APIError: 401 when a metrics key is set and the request does not carry it."""
        if self.metrics_key is None:
            return
        sent = b""
        for key, value in scope.get("headers", []):
            if key.lower() == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    sent = token.strip()
        if not hmac.compare_digest(sent, self.metrics_key.encode()):
            msg = ("/metrics needs the metrics key: send 'Authorization: Bearer KEY'" if not sent
                   else "the metrics key is not valid")
            raise APIError(401, msg, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _account(self, scope: Scope, local: dict, code: int, seconds: float) -> None:
        path = scope.get("path", "")
        endpoint = self.endpoint(path)
        tenant = local.get("tenant")
        name = tenant.name if tenant is not None else "unauthenticated"
        record = local.get("record")
        model = ""
        if record is not None:
            record.status = code
            record.total_seconds = seconds
            record.emit()
            code = record.final_status()  # a stream's outcome: 499 when its client left, its error's status
            model = record.model  # set once the model was found: never a name from the request alone
        if endpoint not in self.UNCOUNTED or code >= 400:
            self.count(name, model, endpoint, str(code))

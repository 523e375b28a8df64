"""The Starlette application: every route, declared in one table, over one :class:`Engine`.

The layers below it: :mod:`gateway.protocols` (one adapter per API), :mod:`gateway.conversation`
(the internal request form and the generation every adapter shares), :mod:`gateway.tenancy`
(keys, limits, usage) and the rest of :mod:`gateway.http` (middleware, errors, SSE).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.config import ServeConfig
from gateway.http import service
from gateway.http.engine_calls import post_to_engine
from gateway.http.errors import APIError, error_style
from gateway.http.middleware import GatewayMiddleware
from gateway.http.openapi import openapi_json
from gateway.protocols.openai_chat import chat_completions
from gateway.protocols.openai_completions import completions
from gateway.protocols.responses import create_response, delete_response, retrieve_response
from gateway.protocols.responses_store import ResponseStore
from gateway.protocols.anthropic import count_tokens, messages
from gateway.telemetry.metrics import GatewayMetrics, prime
from gateway.tenancy.limits import Limiter
from gateway.tenancy.tenants import TenantTable, open_table
from gateway.tenancy.usage import UsageBook
from scheduler import Engine
from scheduler.grammar import Grammars

log = logging.getLogger("mlx_gateway.app")

# (method, path, endpoint): every route the gateway serves.
ROUTES = [
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/responses", create_response),
    ("GET", "/v1/responses/{response_id}", retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response),
    ("POST", "/v1/messages", messages),
    ("POST", "/v1/messages/count_tokens", count_tokens),
    ("GET", "/v1/models", service.models),
    ("GET", "/v1/models/{model_id:path}", service.model),
    ("GET", "/v1/usage", service.usage_report),
    ("POST", "/admin/cache/flush", service.flush_cache),
    ("GET", "/health", service.health),
    ("GET", "/metrics", service.metrics),
    ("GET", "/openapi.json", openapi_json),
]


@dataclass
class ServerState:
    """What the routes need; ``engine`` is None until the model has loaded.

    ``tenants`` is replaced as a whole on reload (SIGHUP); requests in flight keep the
    :class:`Tenant` they started with.
    """

    config: ServeConfig
    registry: CollectorRegistry
    metrics: GatewayMetrics
    model_id: str
    tenants: TenantTable = field(default_factory=lambda: open_table(loopback=True))
    engine: Optional[Engine] = None
    tokenizer: object = None
    context_length: int = 32768
    vocab_size: int = 0
    grammars: Optional[Grammars] = None
    load_error: Optional[str] = None
    draining: bool = False  # set at SIGTERM: no new generation requests (503), running ones finish
    created: int = field(default_factory=lambda: int(time.time()))
    usage: UsageBook = field(default_factory=UsageBook)
    limiter: Limiter = field(default_factory=Limiter)
    responses: ResponseStore = field(default_factory=ResponseStore)

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.responses_store_count, self.config.responses_store_bytes)
        self.limiter.on_limited = lambda tenant, limit: self.metrics.rate_limited.labels(tenant, limit).inc()

    def set_tenants(self, table: TenantTable) -> Optional[Future]:
        """Use ``table`` from now on, create its metric series and apply its cache-group quotas.

        The quotas are applied on the engine thread (a smaller quota evicts snapshots, and
        only that thread may free their MLX arrays), without waiting for it: this runs in
        the SIGHUP handler, on the event loop's thread. Returns a Future done once they
        are applied (it holds the error if they could not be), or None while no engine
        runs (:func:`gateway.server.load_into` applies the table in use once it starts one).
        """
        self.tenants = table
        self.prime_metrics()
        engine = self.engine
        if engine is None or not engine.alive:
            return None
        cache = engine.prompt_cache
        return post_to_engine(engine, lambda: cache.set_quotas(self.tenants.quotas()))  # the newest table

    def prime_metrics(self) -> None:
        """Create the configured tenants' and cache groups' series at 0 (see :func:`prime`).
        Metric series only (no MLX, no cache entries): safe on any thread."""
        tenants = self.tenants.all()
        prime(self.metrics, [t.name for t in tenants], self.model_id)
        if self.engine is not None:
            self.engine.prime_metrics([t.name for t in tenants], {t.cache_group for t in tenants})


# ---------------------------------------------------------------------- assembly
def create_app(state: ServerState) -> Starlette:
    """The ASGI app serving ``state``: routes inside :class:`GatewayMiddleware`, inside
    CORS (``config.allowed_origins``; ``chrome-extension://ID`` and
    ``moz-extension://ID`` origins are matched like any other)."""
    routes = [Route(path, endpoint, methods=[method]) for method, path, endpoint in ROUTES]

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        error = APIError(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}")
        return error.response(error_style(request.url.path))

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = state
    app.add_middleware(GatewayMiddleware, state=state)
    if state.config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                            "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                            "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"],
            max_age=600,
        )
    return app

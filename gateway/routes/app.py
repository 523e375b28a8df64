"""The Starlette application serving the routes of :mod:`gateway.routes.table`.

The floors below it: :mod:`gateway.protocols` (one adapter per API),
:mod:`gateway.conversation` (admitting a call, the internal request form and the
generation every adapter shares), :mod:`gateway.models` (the model registry),
:mod:`gateway.tenancy` (keys, limits, usage) and :mod:`gateway.http` (middleware,
errors, SSE, bodies, hosts).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.front import Front
from gateway.http.cors import DynamicCORS
from gateway.http.errors import APIError
from gateway.http.origins import configured_origins
from gateway.http.hosts import HostPolicy
from gateway.http.middleware import GatewayMiddleware, metrics_key
from gateway.protocols.reasoning_seal import LazySeal
from gateway.protocols.responses_store_open import open_response_store
from gateway.routes.table import ROUTES, error_style, metrics_label, resolve


def create_app(front: Front, registry: CollectorRegistry) -> Starlette:
    """The ASGI app serving ``front``, with its metrics on ``registry``: routes inside
    :class:`GatewayMiddleware`, inside CORS (``config.allowed_origins``, else
    ``OLLAMA_ORIGINS``, and the tenants' ``origins``, as Ollama's patterns; Ollama's local
    origins on its API: :class:`gateway.http.cors.DynamicCORS`), and the stored responses of
    ``config.responses_store``.

    Raises:
        ValueError, OSError, sqlite3.Error: the response store cannot be opened, or
            ``OLLAMA_ORIGINS`` holds a bad pattern.
    """
    cfg = front.config
    routes = [Route(r.path, resolve(r.handler), methods=list(r.methods)) for r in ROUTES]

    async def not_found(request: Request, exc) -> Response:
        code = getattr(exc, "status_code", 404)
        error = APIError(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}")
        return error.response(error_style(request.url.path))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await front.limiter.aclose()  # a shared limits store's connections and flusher
        await app.state.responses.aclose()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
    app.state.front = front
    app.state.registry = registry
    app.state.responses = open_response_store(cfg, lambda: [t.name for t in front.tenants.all()])
    app.state.reasoning_seal = LazySeal()
    registry.register(app.state.responses.metrics)
    m = front.metrics

    def refused(tenant: str, error: APIError) -> None:
        if error.code == "origin_not_allowed":
            m.origin_refused.labels(tenant).inc()

    app.add_middleware(GatewayMiddleware, hosts=HostPolicy(cfg.host, cfg.allowed_hosts),
                       max_header_bytes=cfg.max_header_bytes, metrics_key=metrics_key(cfg.metrics_key),
                       count=lambda tenant, model, endpoint, code: m.requests.labels(tenant, model, endpoint,
                                                                                     code).inc(),
                       on_error=refused, error_style=error_style, endpoint=metrics_label)
    app.add_middleware(DynamicCORS, allow_origins=configured_origins(cfg.allowed_origins),
                       more=lambda: front.tenants.origins())
    return app

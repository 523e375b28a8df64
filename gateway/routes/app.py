"""The Starlette application: every route, declared in one table.

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

from gateway.conversation.calls import Front
from gateway.http.cors import DynamicCORS
from gateway.http.errors import APIError, error_style
from gateway.http.hosts import HostPolicy
from gateway.http.middleware import GatewayMiddleware, metrics_key
from gateway.protocols.anthropic import count_tokens, messages
from gateway.protocols.embeddings import embeddings
from gateway.protocols.openai_chat import chat_completions
from gateway.protocols.openai_completions import completions
from gateway.protocols.responses import create_response, delete_response, list_input_items, retrieve_response
from gateway.protocols.reasoning_seal import LazySeal
from gateway.protocols.responses_store_open import open_response_store
from gateway.routes import admin, lora, service
from gateway.routes.openapi import openapi_json

# (method, path, endpoint): every route the gateway serves.
ROUTES = [
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/embeddings", embeddings),
    ("POST", "/v1/responses", create_response),
    ("GET", "/v1/responses/{response_id}", retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response),
    ("GET", "/v1/responses/{response_id}/input_items", list_input_items),
    ("POST", "/v1/messages", messages),
    ("POST", "/v1/messages/count_tokens", count_tokens),
    ("GET", "/v1/models", service.models),
    ("GET", "/v1/models/{model_id:path}", service.model),
    ("GET", "/v1/usage", service.usage_report),
    ("POST", "/v1/load_lora_adapter", lora.load_lora_adapter),
    ("POST", "/v1/unload_lora_adapter", lora.unload_lora_adapter),
    ("POST", "/admin/cache/flush", admin.flush_cache),
    ("GET", "/admin/models", admin.list_models),
    ("POST", "/admin/models/{name:path}/load", admin.load_model),
    ("POST", "/admin/models/{name:path}/unload", admin.unload_model),
    ("GET", "/health", service.health),
    ("GET", "/metrics", service.metrics),
    ("GET", "/server_info", service.server_info),
    ("GET", "/get_server_info", service.server_info),
    ("GET", "/model_info", service.model_info),
    ("GET", "/get_model_info", service.model_info),
    ("GET", "/get_load", service.get_load),
    ("GET", "/openapi.json", openapi_json),
]


def create_app(front: Front, registry: CollectorRegistry) -> Starlette:
    """The ASGI app serving ``front``, with its metrics on ``registry``: routes inside
    :class:`GatewayMiddleware`, inside CORS (``config.allowed_origins`` and the tenants'
    ``origins``; ``chrome-extension://ID`` and ``moz-extension://ID`` origins are matched
    like any other), and the stored responses of ``config.responses_store``.

    Raises:
        ValueError, OSError, sqlite3.Error: the response store cannot be opened.
    """
    cfg = front.config
    routes = [Route(path, endpoint, methods=[method]) for method, path, endpoint in ROUTES]

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
                       on_error=refused)
    app.add_middleware(DynamicCORS, allow_origins=cfg.allowed_origins, more=lambda: front.tenants.origins())
    return app

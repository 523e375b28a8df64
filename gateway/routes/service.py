"""The routes that generate nothing: models, usage, cache flush, health and metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.http.body import read_json
from gateway.http.calls import model_names, ready_engine
from gateway.http.engine_calls import on_engine
from gateway.http.errors import APIError
from gateway.tenancy.auth import authenticate, authenticate_admin, identify

if TYPE_CHECKING:
    from gateway.http.app import ServerState


def _model(state: "ServerState", name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlx-gateway"}


async def models(request: Request) -> Response:
    """``GET /v1/models``: the served model's names that the caller may use."""
    state: "ServerState" = request.app.state.gateway
    tenant = authenticate(state.tenants, request)
    return JSONResponse({"object": "list", "data": [_model(state, n) for n in model_names(state, tenant)]})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one model (404 when not served, or not for this key)."""
    state: "ServerState" = request.app.state.gateway
    tenant = authenticate(state.tenants, request)
    name = request.path_params["model_id"]
    if name not in model_names(state, tenant):
        raise APIError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model(state, name))


async def usage_report(request: Request) -> Response:
    """``GET /v1/usage``: the calling tenant's usage; an admin key sees every tenant."""
    state: "ServerState" = request.app.state.gateway
    tenant, admin = identify(state.tenants, request)
    if not admin:
        return JSONResponse(state.usage.report(tenant.name))
    return JSONResponse({"object": "list", "data": [state.usage.report(t.name) for t in state.tenants.all()]})


async def flush_cache(request: Request) -> Response:
    """``POST /admin/cache/flush`` with an optional body ``{"cache_group": NAME}``
    (absent or null: every group). Leased snapshots stay. The flush runs on the engine
    thread between two steps: dropping snapshots frees MLX arrays."""
    state: "ServerState" = request.app.state.gateway
    authenticate_admin(state.tenants, request)
    engine = ready_engine(state)
    cfg = state.config
    body = await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth) \
        if request.headers.get("content-length", "0") != "0" else {}
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    group = body.get("cache_group")
    if group is not None and not isinstance(group, str):
        raise APIError(400, "cache_group must be a string", param="cache_group")
    cache = engine.prompt_cache
    dropped = await on_engine(engine, lambda: cache.flush(group))
    return JSONResponse({"object": "cache.flush", "cache_group": group, "dropped_snapshots": dropped})


async def health(request: Request) -> Response:
    state: "ServerState" = request.app.state.gateway
    if state.draining:
        return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, status_code=503)
    if state.engine is None:
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
    if not state.engine.alive:
        return JSONResponse({"status": "dead", "detail": repr(state.engine.error)}, status_code=503)
    return JSONResponse({
        "status": "ok",
        "model": state.model_id,
        "running": state.engine.num_running,
        "waiting": state.engine.num_waiting,
    })


async def metrics(request: Request) -> Response:
    state: "ServerState" = request.app.state.gateway
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

"""The admin routes (admin keys only): the prefix caches and the models.

- ``POST /admin/cache/flush``: drop unleased prefix-cache snapshots (every model's, or
  one ``model``'s; every cache group, or one ``cache_group``'s).
- ``GET /admin/models``: each model's state, bytes, last use and requests in flight.
- ``POST /admin/models/{name}/load`` and ``/unload``.

Whatever touches a prefix cache is asked of the model's engine, which runs it on the
engine thread between two steps (snapshots are MLX arrays).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.start import unavailable
from gateway.front import Front
from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.models.slot import ModelUnavailable, Slot
from gateway.tenancy.auth import authenticate_admin
from scheduler import EngineDead


async def on_engine(fn: Callable[[], Any]) -> Any:
    """``fn()`` (a blocking call on an engine) in a worker thread.

    Raises:
        APIError: 503 when the engine is not running or did not answer in time.
    """
    try:
        return await anyio.to_thread.run_sync(fn)
    except EngineDead as e:
        raise APIError(503, f"the model engine is not available: {e}", code="engine_unavailable")
    except TimeoutError:
        raise APIError(503, "the model engine did not answer in time", code="engine_busy",
                       headers={"Retry-After": "1"})


async def _body(front: Front, request: Request) -> dict:
    cfg = front.config
    body = await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth) \
        if request.headers.get("content-length", "0") != "0" else {}
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _slot(front: Front, name: str) -> Slot:
    slot = front.models.find(name)
    if slot is None:
        raise APIError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
    return slot


async def flush_cache(request: Request) -> Response:
    """``POST /admin/cache/flush`` with an optional body ``{"cache_group": NAME, "model":
    NAME}`` (absent or null: every group, every loaded model). Leased snapshots stay."""
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    body = await _body(front, request)
    group, name = body.get("cache_group"), body.get("model")
    if group is not None and not isinstance(group, str):
        raise APIError(400, "cache_group must be a string", param="cache_group")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "model must be a string", param="model")
    handles = front.models.handles()
    if name is not None:
        slot = _slot(front, name)
        handles = [h for h in handles if h.name == slot.name]
    dropped = 0
    for h in handles:
        dropped += await on_engine(lambda h=h: h.engine.flush_cache(group))
    return JSONResponse({"object": "cache.flush", "cache_group": group, "model": name, "dropped_snapshots": dropped})


def model_report(slot: Slot) -> dict:
    """What ``GET /admin/models`` says of one model."""
    h = slot.handle
    return {"id": slot.name, "aliases": list(slot.spec.aliases), "path": slot.spec.path, "state": slot.state,
            "pinned": slot.spec.pin, "keep_alive": slot.keep_alive,
            "weights_bytes": h.weights_bytes if h is not None else 0,
            "prefix_cache_bytes": h.engine.cache_bytes if h is not None else 0, "requests_in_flight": slot.in_flight,
            "running": h.engine.num_running if h is not None else 0,
            "waiting": h.engine.num_waiting if h is not None else 0, "last_used": slot.last_used_wall,
            "idle_seconds": (time.monotonic() - slot.last_used) if slot.last_used else None,
            "loaded_at": h.loaded_at if h is not None else None, "error": slot.error}


async def list_models(request: Request) -> Response:
    """``GET /admin/models``: every configured model's state and memory."""
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    registry = front.models
    return JSONResponse({"object": "list", "memory_budget_bytes": registry.budget,
                         "max_loaded_models": registry.max_loaded or None,
                         "prefix_cache_bytes": registry.cache_budget.nbytes if registry.cache_budget else None,
                         "data": [model_report(s) for s in registry.slots]})


async def load_model(request: Request) -> Response:
    """``POST /admin/models/{name}/load``: load it (waits for the load); its report.

    Raises:
        APIError: 404 for an unknown model, 503 (with Retry-After) when it cannot be loaded.
    """
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    slot = _slot(front, request.path_params["name"])
    try:
        await asyncio.wrap_future(front.models.load(slot))
    except ModelUnavailable as e:
        raise unavailable(e)
    return JSONResponse(model_report(slot))


async def unload_model(request: Request) -> Response:
    """``POST /admin/models/{name}/unload``: unload it (its prefix cache goes to the disk
    tier, if any); its report.

    Raises:
        APIError: 404 for an unknown model; 409 for one that is pinned, loading or serving.
    """
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    slot = _slot(front, request.path_params["name"])
    try:
        await anyio.to_thread.run_sync(front.models.unload, slot)
    except ValueError as e:
        raise APIError(409, str(e), param="model", code="model_busy")
    return JSONResponse(model_report(slot))

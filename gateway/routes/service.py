"""The routes that generate nothing: models, usage, health and metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.calls import Front
from gateway.http.errors import APIError
from gateway.models.registry import Slot
from gateway.tenancy.auth import authenticate, identify


def model_object(front: Front, slot: Slot, name: str) -> dict:
    """One entry of ``/v1/models``: OpenAI's model object, plus whether the model is
    ``loaded`` and ``pinned``, and which served model an alias ``alias_of``."""
    out = {"id": name, "object": "model", "created": front.created, "owned_by": "mlx-gateway",
           "loaded": slot.state == "loaded", "pinned": slot.spec.pin}
    if name != slot.name:
        out["alias_of"] = slot.name
    return out


async def models(request: Request) -> Response:
    """``GET /v1/models``: every model (and alias) the caller may use."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    data = [model_object(front, s, n) for s, n in front.visible(tenant)]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one model (404 when not served, or not for this key)."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    name = request.path_params["model_id"]
    slot = front.models.find(name)
    if slot is None or not tenant.may_use(name):
        raise APIError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(model_object(front, slot, name))


async def usage_report(request: Request) -> Response:
    """``GET /v1/usage``: the calling tenant's usage; an admin key sees every tenant."""
    front: Front = request.app.state.front
    tenant, admin = identify(front.tenants, request)
    if not admin:
        return JSONResponse(front.usage.report(tenant.name))
    return JSONResponse({"object": "list", "data": [front.usage.report(t.name) for t in front.tenants.all()]})


async def health(request: Request) -> Response:
    """``GET /health``: 200 ``ok`` once the models to load at start are loaded, with each
    model's state; 503 while they load, when a pinned one failed, or while draining."""
    front: Front = request.app.state.front
    if front.draining:
        return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, status_code=503)
    status, detail = front.models.startup()
    if status != "ok":
        return JSONResponse({"status": status, "detail": detail}, status_code=503)
    if not front.models.loop.alive:
        return JSONResponse({"status": "dead", "detail": repr(front.models.loop.error)}, status_code=503)
    handles = front.models.handles()
    return JSONResponse({
        "status": "ok",
        "model": front.models.slots[0].name,
        "models": {s.name: s.state for s in front.models.slots},
        "running": sum(h.engine.num_running for h in handles),
        "waiting": sum(h.engine.num_waiting for h in handles),
    })


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

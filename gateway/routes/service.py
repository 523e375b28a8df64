"""The routes that generate nothing: models, usage, health, metrics, and the worker
information a router in front of several gateways reads (``/server_info``,
``/model_info``, ``/get_load``: see docs/cluster.md)."""

from __future__ import annotations

import json
import os
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.front import Front
from gateway.http.errors import APIError
from gateway.models.slot import Slot
from gateway.routes.model_metadata import capabilities, codex_entry, context_window
from gateway.tenancy.auth import authenticate, identify


def model_object(front: Front, slot: Slot, name: str) -> dict:
    """One entry of ``/v1/models``: OpenAI's model object, plus whether the model is
    ``loaded`` and ``pinned``, its ``kind`` (``text``, ``vision`` or ``embedding``; known
    once it has been loaded, or when the models file says it), which served model an
    alias ``alias_of``, its ``context_length`` (also as vLLM's ``max_model_len``; tokens,
    prompt and answer), ``max_output_tokens`` and ``capabilities``
    (:mod:`gateway.routes.model_metadata`)."""
    kind = slot.handle.kind if slot.handle is not None else slot.kind
    out = {"id": name, "object": "model", "created": front.created, "owned_by": "mlx-gateway",
           "loaded": slot.state == "loaded", "pinned": slot.spec.pin}
    if kind is not None:
        out["kind"] = kind
    adapter = front.adapters.get(name)
    if adapter is not None:  # vLLM's fields of a LoRA adapter
        out["parent"], out["root"] = slot.name, adapter.path
    elif name != slot.name:
        out["alias_of"] = slot.name
    window = context_window(slot, hf_config(model_dir(slot)) if slot.handle is None else {})
    if window is not None:
        out["context_length"] = out["max_model_len"] = window
    if kind != "embedding":
        out["max_output_tokens"] = slot.spec.max_tokens_limit
    out["capabilities"] = capabilities(slot, kind)
    return out


async def models(request: Request) -> Response:
    """``GET /v1/models``: every model (and alias) the caller may use; with a
    ``client_version`` query (Codex CLI's model catalog request) the same models as
    Codex's catalog too, under ``models``."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    data = [model_object(front, s, n) for s, n in front.visible(tenant)]
    body: dict = {"object": "list", "data": data}
    if "client_version" in request.query_params:
        body["models"] = [codex_entry(d["id"], d.get("context_length"), d["capabilities"]) for d in data
                          if "embedding" not in d["capabilities"]]
    return JSONResponse(body)


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}``: one model (404 when not served, or not for this key)."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    name = request.path_params["model_id"]
    slot = next((s for s, n in front.visible(tenant) if n == name), None)
    if slot is None:
        raise APIError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(model_object(front, slot, name))


async def usage_report(request: Request) -> Response:
    """``GET /v1/usage``: the calling tenant's usage; an admin key sees every tenant."""
    front: Front = request.app.state.front
    tenant, admin = identify(front.tenants, request)
    if not admin:
        return JSONResponse(front.usage.report(tenant.name))
    return JSONResponse({"object": "list", "data": [front.usage.report(t.name) for t in front.tenants.all()]})


async def cache_explain(request: Request) -> Response:
    """``GET /v1/cache/explain``: why the last requests' prompts left the prefix cache where
    they did (:mod:`gateway.telemetry.cache_explain`), newest first; with ``request_id``,
    that request's (404 when it is not among the last ones). A key sees its tenant's
    requests only; an admin key every tenant's.

    Raises:
        APIError: 400 for a ``limit`` that is not an integer from 1 to 500, 404 for an
            unknown ``request_id``.
    """
    front: Front = request.app.state.front
    tenant, admin = identify(front.tenants, request)
    q = request.query_params
    try:
        limit = int(q.get("limit", "50"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 500:
        raise APIError(400, "limit must be an integer from 1 to 500", param="limit")
    rid = q.get("request_id")
    found = front.explainer.find(rid, None if admin else tenant.name, limit)
    if rid is not None and not found:
        raise APIError(404, f"no explanation for request '{rid}' (unknown, another key's, or too old)",
                       param="request_id", code="not_found")
    data = [w.record() for w in found]
    if rid is not None:
        return JSONResponse({"object": "cache.explanation", **data[0]})
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    """``GET /health``: 200 ``ok`` once the models to load at start are loaded, with each
    model's state; 503 while they load, when a pinned one failed, while draining, and
    while the engine loop is ``dead`` or ``stalled`` (:mod:`scheduler.engine.watchdog`)."""
    front: Front = request.app.state.front
    if front.draining:
        return JSONResponse({"status": "draining", "detail": "the server is shutting down"}, status_code=503)
    status, detail = front.models.startup()
    if status != "ok":
        return JSONResponse({"status": status, "detail": detail}, status_code=503)
    if not front.models.loop.alive:
        return JSONResponse({"status": "dead", "detail": repr(front.models.loop.error)}, status_code=503)
    if front.models.loop.beat.stalled is not None:
        return JSONResponse({"status": "stalled", "detail": front.models.loop.beat.stalled}, status_code=503)
    return JSONResponse({"status": "ok", "model": front.models.slots[0].name,
                         "models": {s.name: s.state for s in front.models.slots}, **_load(front)})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------ worker information
# What SGLang's router (sglang-router, "SGLang Model Gateway") asks of each worker it is
# given: /server_info and /model_info when it registers one (falling back to
# /get_server_info and /get_model_info), /get_load for load-based policies. Open like
# /health, and revealing no more than it does: served names, engine sizes and load.


def model_dir(slot: Slot) -> Optional[str]:
    """Where ``slot``'s model came from: an absolute directory for a local one, the hub id
    for one from the hub; the spec's path until it is loaded (``demo``/``default`` then
    resolve at load)."""
    path = slot.handle.path if slot.handle is not None else slot.spec.path
    if slot.handle is None and path in ("demo", "default"):
        return None
    return os.path.abspath(path) if os.path.isdir(path) else path


def hf_config(path: Optional[str]) -> dict:
    """The model's ``config.json`` (a local directory, or a hub id already in the local hub
    cache; nothing is downloaded); ``{}`` when not at hand."""
    if not path:
        return {}
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(path, "config.json")
        except Exception:  # not a hub id, or no hub library
            return {}
        if not isinstance(found, str):
            return {}
        file = found
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-gateway")
    except PackageNotFoundError:
        return "unknown"


def _load(front: Front) -> dict:
    handles = front.models.handles()
    return {"running": sum(h.engine.num_running for h in handles),
            "waiting": sum(h.engine.num_waiting for h in handles)}


async def server_info(request: Request) -> Response:
    """``GET /server_info`` (also ``/get_server_info``): the first model as
    ``served_model_name`` and ``model_path`` (the router's model id and tokenizer source),
    every served model, the engine sizes and the current load."""
    front: Front = request.app.state.front
    cfg = front.config
    first = front.models.slots[0]
    models = []
    for slot in front.models.slots:
        handle = slot.handle
        models.append({"name": slot.name, "aliases": list(slot.spec.aliases), "model_path": model_dir(slot),
                       "state": slot.state, "context_length": handle.context_length if handle is not None else None})
    return JSONResponse({
        "served_model_name": first.name, "served_model_names": [n for s in front.models.slots for n in s.spec.names],
        "model_path": model_dir(first), "version": _version(), "engine": "mlx-gateway", "dp_size": 1,
        "max_running_requests": cfg.decode_concurrency, "max_prefill_requests": cfg.prompt_concurrency,
        "max_prefill_tokens": cfg.prefill_step_size, "max_queued_requests": cfg.max_waiting, "models": models,
        "load": _load(front), "draining": front.draining})


async def model_info(request: Request) -> Response:
    """``GET /model_info`` (also ``/get_model_info``): the first model's path, tokenizer,
    type and architectures (from its ``config.json`` when at hand)."""
    front: Front = request.app.state.front
    first = front.models.slots[0]
    path = model_dir(first)
    config = hf_config(path)
    return JSONResponse({
        "model_path": path, "tokenizer_path": path, "served_model_name": first.name, "is_generation": True,
        "model_type": config.get("model_type"), "architectures": config.get("architectures"),
        "context_length": first.handle.context_length if first.handle is not None else None})


async def get_load(request: Request) -> Response:
    """``GET /get_load``: requests running and waiting over every loaded model, as
    ``{"load": n, ...}`` (what a load-based router policy reads)."""
    load = _load(request.app.state.front)
    return JSONResponse({"load": load["running"] + load["waiting"], "num_reqs": load["running"],
                         "num_waiting_reqs": load["waiting"]})

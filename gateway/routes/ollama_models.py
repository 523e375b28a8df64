"""Ollama's model routes on the models registry: ``GET /`` and ``/api/version`` (what
clients probe), ``/api/tags`` and ``/api/ps`` (the models, the loaded ones),
``/api/show`` (one model's details, ``model_info`` and ``capabilities``), and the
management calls where they map: ``/api/pull`` loads a served model, ``/api/copy``
(admin keys) serves a model under one more name, ``/api/create`` with only ``from`` does
the same; what would build, delete or upload model files is refused with a 400 saying
so. A model the key may not use answers 404, like one not served.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from gateway.front import Front
from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, to_json
from gateway.models.slot import ModelUnavailable, Slot
from gateway.protocols.ollama_schemas import (OLLAMA_VERSION, CopyRequest, CreateRequest, ModelRequest, parse,
                                              served_name, timestamp)
from gateway.routes.model_metadata import capabilities, context_window
from gateway.routes.service import hf_config, model_dir
from gateway.tenancy.auth import authenticate, identify
from gateway.tenancy.tenants import Tenant

NEVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded (Ollama prints a far future too)


async def root(request: Request) -> Response:
    """``GET /`` and ``HEAD /``: ``Ollama is running``, as clients probe for."""
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    """``GET /api/version``: the Ollama release whose API this follows."""
    return JSONResponse({"version": OLLAMA_VERSION})


# ---------------------------------------------------------------------- describing
def _kind(slot: Slot) -> Optional[str]:
    return slot.handle.kind if slot.handle is not None else slot.kind


def ollama_capabilities(slot: Slot) -> list[str]:
    """Ollama's names: ``completion``, ``tools``, ``thinking``, ``vision``, ``embedding``."""
    names = {"reasoning": "thinking"}
    return [names.get(c, c) for c in capabilities(slot, _kind(slot)) if c != "chat"]


def _config(slot: Slot) -> dict:
    return hf_config(model_dir(slot))


def _quantization(config: dict) -> str:
    q = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("bits"):
        return f"Q{q['bits']}"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return {"bfloat16": "BF16", "float32": "F32"}.get(dtype, "F16")


def _parameters(slot: Slot, config: dict) -> int:
    """Parameters, from the bytes its weights take (an estimate for quantized models)."""
    q = _quantization(config)
    per = int(q[1:]) if q.startswith("Q") else {"F32": 32}.get(q, 16)
    return int(slot.weights * 8 / per) if slot.weights else 0


def _size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def details(slot: Slot, config: dict) -> dict:
    """Ollama's ``details``: format, family (the ``model_type``), parameter size,
    quantization."""
    family = config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "unknown"
    path = slot.spec.path
    return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors", "family": family,
            "families": [family], "parameter_size": _size(_parameters(slot, config)),
            "quantization_level": _quantization(config)}


def digest(slot: Slot) -> str:
    """A stable id of the served model (its name and path), hex like Ollama's digests."""
    return hashlib.sha256(f"{slot.name}\0{slot.spec.path}".encode()).hexdigest()


def _modified(slot: Slot, front: Front) -> str:
    if slot.handle is not None:
        return timestamp(slot.handle.loaded_at)
    path = model_dir(slot)
    try:
        return timestamp(os.path.getmtime(path)) if path and os.path.exists(path) else timestamp(front.created)
    except OSError:
        return timestamp(front.created)


def _find(front: Front, tenant: Tenant, name: str) -> Slot:
    """Raises:
        APIError: 404 for a model not served, or not for this key."""
    served = served_name(front, name)
    slot = front.models.find(served)
    if slot is None or not tenant.may_use(served):
        raise APIError(404, f"model '{name}' not found", param="model", code="model_not_found")
    return slot


async def tags(request: Request) -> Response:
    """``GET /api/tags``: every model (and alias) the key may use."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    out = []
    for slot, name in front.visible(tenant):
        config = _config(slot)
        out.append({"name": name, "model": name, "modified_at": _modified(slot, front), "size": slot.weights,
                    "digest": digest(slot), "details": details(slot, config)})
    return JSONResponse({"models": out})


async def ps(request: Request) -> Response:
    """``GET /api/ps``: the loaded models the key may use, with when they unload."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    out = []
    for slot, name in front.visible(tenant):
        if slot.state != "loaded" or name != slot.name:
            continue
        keep = None if slot.spec.pin else slot.keep_alive
        expires = NEVER if keep is None else timestamp(time.time() + max(0.0, keep - (time.monotonic() - slot.last_used)))
        h = slot.handle
        out.append({"name": name, "model": name, "size": h.weights_bytes + h.engine.cache_bytes,
                    "digest": digest(slot), "details": details(slot, _config(slot)), "expires_at": expires,
                    "size_vram": h.weights_bytes, "context_length": context_window(slot, {})})
    return JSONResponse({"models": out})


async def _body(front: Front, request: Request):
    cfg = front.config
    return await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth)


async def show(request: Request) -> Response:
    """``POST /api/show``: ``details``, ``model_info`` (architecture, context length,
    sizes from ``config.json``), ``capabilities``, ``template`` (the chat template),
    ``parameters`` (the sampling defaults) and ``modelfile``.

    Raises:
        APIError: 400 without a model, 404 for one not served.
    """
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    req = parse(ModelRequest, await _body(front, request))
    slot = _find(front, tenant, req.target)
    config = _config(slot)
    d = details(slot, config)
    arch = d["family"]
    text = config.get("text_config") or config
    info = {"general.architecture": arch, "general.parameter_count": _parameters(slot, config)}
    window = context_window(slot, config)
    for key, value in (("context_length", window), ("embedding_length", text.get("hidden_size")),
                       ("block_count", text.get("num_hidden_layers")),
                       ("attention.head_count", text.get("num_attention_heads")),
                       ("attention.head_count_kv", text.get("num_key_value_heads")),
                       ("vocab_size", text.get("vocab_size"))):
        if value is not None:
            info[f"{arch}.{key}"] = value
    spec = slot.spec
    params = f"temperature {spec.temp}\ntop_p {spec.top_p}\ntop_k {spec.top_k}\nmin_p {spec.min_p}\n" \
             f"num_predict {spec.max_tokens}"
    template = getattr(slot.handle.tokenizer, "chat_template", None) if slot.handle is not None else None
    return JSONResponse({"modelfile": f"# served by mlx-gateway\nFROM {spec.path}\n", "parameters": params,
                         "template": template or "", "details": d, "model_info": info,
                         "capabilities": ollama_capabilities(slot), "modified_at": _modified(slot, front),
                         "license": ""})


def _status_lines(statuses: list[str]) -> AsyncIterator[bytes]:
    async def run() -> AsyncIterator[bytes]:
        for s in statuses:
            yield (to_json({"status": s}) + "\n").encode()
    return run()


def _statuses(front: Front, stream: bool, statuses: list[str]) -> Response:
    if stream is False:
        return JSONResponse({"status": statuses[-1]})
    return SSEResponse(_status_lines(statuses), send_timeout=front.config.client_timeout,
                       media_type="application/x-ndjson")


async def pull(request: Request) -> Response:
    """``POST /api/pull``: load a served model (nothing is downloaded: the models are the
    configuration's); ``{"status": "success"}`` once loaded (streamed as status lines).

    Raises:
        APIError: 404 for a model not served, 503 when it cannot be loaded.
    """
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    req = parse(ModelRequest, await _body(front, request))
    name = served_name(front, req.target)
    slot = front.models.find(name)
    if slot is None or not tenant.may_use(name):
        raise APIError(404, f"pull model manifest: model '{name}' is not served here: this gateway serves the "
                       "models of its configuration (--model, --models FILE) and downloads none on request",
                       param="model", code="model_not_found")
    try:
        await asyncio.wrap_future(front.models.load(slot))
    except ModelUnavailable as e:
        raise APIError(503, e.message, param="model", code=e.code)
    return _statuses(front, req.stream, ["pulling manifest", "verifying sha256 digest", "success"])


async def copy(request: Request) -> Response:
    """``POST /api/copy`` (admin keys): serve ``source`` as ``destination`` too, until the
    server stops. 200 with no body, as Ollama answers.

    Raises:
        APIError: 403 for a key that is not an admin's, 404 for an unknown source, 400
            for a destination already taken.
    """
    front: Front = request.app.state.front
    _admin(front, request, "copy")
    req = parse(CopyRequest, await _body(front, request))
    _alias(front, req.source, req.destination)
    return Response(status_code=200)


def _admin(front: Front, request: Request, what: str) -> None:
    _, admin = identify(front.tenants, request)
    if not admin:
        raise APIError(403, f"{what}: only an admin key may add model names", code="permission_denied")


def _alias(front: Front, source: str, destination: str) -> None:
    slot = front.models.find(source)
    if slot is None:
        raise APIError(404, f"model '{source}' not found", param="source", code="model_not_found")
    try:
        front.models.add_alias(destination, slot)
    except ValueError as e:
        raise APIError(400, str(e), param="destination") from None


async def create(request: Request) -> Response:
    """``POST /api/create``: with only ``from`` (a served model), an alias like
    :func:`copy` (admin keys); building a model (files, adapters, quantize, template,
    system, parameters, messages, a Modelfile) is refused.

    Raises:
        APIError: 400 for what cannot be built, 403, 404 for an unknown ``from``.
    """
    front: Front = request.app.state.front
    req = parse(CreateRequest, await _body(front, request))
    name = req.target
    built = [f for f in ("files", "adapters", "quantize", "template", "system", "parameters", "messages",
                         "modelfile", "license") if getattr(req, f)]
    if built or not req.from_:
        raise APIError(400, f"create: this gateway does not build models ({', '.join(built) or 'no from'}); it "
                       "serves the models of its configuration: add one to the models file, or create with only "
                       "'from' to serve a model under another name")
    _admin(front, request, "create")
    _alias(front, req.from_, name)
    return _statuses(front, req.stream, ["using existing layer", "writing manifest", "success"])


async def delete(request: Request) -> Response:
    """``DELETE /api/delete``: refused (400; 404 for a model not served): the gateway
    deletes no model files."""
    front: Front = request.app.state.front
    tenant = authenticate(front.tenants, request)
    req = parse(ModelRequest, await _body(front, request))
    _find(front, tenant, req.target)
    raise APIError(400, f"delete: this gateway deletes no models; remove '{req.target}' from its models file, or "
                   "unload it (POST /admin/models/NAME/unload, or /api/generate with keep_alive 0)")


async def push(request: Request) -> Response:
    """``POST /api/push``: refused (400): the gateway has no registry to upload to."""
    front: Front = request.app.state.front
    authenticate(front.tenants, request)
    raise APIError(400, "push: this gateway serves local models and has no registry to push them to")

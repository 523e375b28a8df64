"""vLLM's LoRA routes (admin keys only).

- ``POST /v1/load_lora_adapter`` ``{"lora_name": NAME, "lora_path": PATH}`` (optionally
  ``"base_model_name"``; default the first served model): read and check the adapter on
  its base model's engine and serve it as ``NAME``; a 400 naming what does not fit, and
  nothing kept, when it does not fit the model. Loading a served name again replaces it
  (running requests finish on the old one).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": NAME}``: stop serving it (404 when it
  is not served); running requests finish on it.

Both answer in plain text, as vLLM does.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.conversation.start import unavailable
from gateway.front import Front
from gateway.http.errors import APIError
from gateway.models.lora import Adapter, load_on_engine, unload_on_engine
from gateway.models.slot import ModelUnavailable
from gateway.routes.admin import _body, on_engine
from gateway.tenancy.auth import authenticate_admin


def _name(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v.strip():
        raise APIError(400, f"{key} must be a non-empty string", param=key)
    return v.strip()


async def load_lora_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter`` (see the module docstring)."""
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    body = await _body(front, request)
    name, path = _name(body, "lora_name"), _name(body, "lora_path")
    base = body.get("base_model_name") or front.models.slots[0].name
    slot = front.models.find(front.adapters.base_of(base) if isinstance(base, str) else None)
    if slot is None:
        raise APIError(404, f"the model '{base}' does not exist", param="base_model_name", code="model_not_found")
    if front.models.find(name) is not None:
        raise APIError(400, f"'{name}' is the name of a served model", param="lora_name")
    future = front.models.hold(slot)
    try:
        try:
            handle = await asyncio.wrap_future(future)
        except ModelUnavailable as e:
            raise unavailable(e)
        adapter = Adapter(name, path, slot.name)
        await on_engine(lambda: load_on_engine(handle, front.config, adapter, replace=True))
        front.adapters.add(adapter)
    finally:
        front.models.release(slot)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter`` (see the module docstring)."""
    front: Front = request.app.state.front
    authenticate_admin(front.tenants, request)
    body = await _body(front, request)
    name = _name(body, "lora_name")
    adapter = front.adapters.remove(name)
    if adapter is None:
        raise APIError(404, f"the LoRA adapter '{name}' is not served", param="lora_name", code="lora_not_found")
    slot = front.models.find(adapter.base)
    if slot is not None and slot.handle is not None:
        await on_engine(lambda: unload_on_engine(slot.handle, name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

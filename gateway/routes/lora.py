"""vLLM's LoRA routes (admin keys, and tenants whose ``manage_adapters`` is set).

- ``POST /v1/load_lora_adapter`` ``{"lora_name": NAME, "lora_path": PATH}`` (optionally
  ``"base_model_name"``; default the first served model): read and check the adapter on
  its base model's engine and serve it as ``NAME``; a 400 naming what does not fit, and
  nothing kept, when it does not fit the model; a 503 when the memory budget has no room
  for it, or every adapter slot is held by running requests (``lora_slots_busy``: it does
  not wait, as a request does). Loading a served name again replaces it (running requests
  finish on the old one).
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": NAME}``: stop serving it (404 when it
  is not served); running requests finish on it.

A tenant allowed to manage adapters may load and unload only adapters it may use
(:meth:`gateway.tenancy.tenants.Tenant.may_use_adapter`) on base models it may see; others
are a 404, as for models it may not use. Both answer in plain text, as vLLM does.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.conversation.start import unavailable
from gateway.front import Front
from gateway.http.errors import APIError
from gateway.models.lora import Adapter, load_on_engine, unload_on_engine
from gateway.models.slot import ModelUnavailable
from gateway.routes.admin import _body, on_engine
from gateway.tenancy.auth import identify
from gateway.tenancy.tenants import Tenant
from scheduler.lora import AdapterBusy


def _name(body: dict, key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v.strip():
        raise APIError(400, f"{key} must be a non-empty string", param=key)
    return v.strip()


def _manager(front: Front, request: Request) -> Optional[Tenant]:
    """None for an admin key; the tenant for a tenant's key that may manage adapters.

    Raises:
        APIError: 401 for a missing or unknown key; 403 for a tenant that may not."""
    tenant, admin = identify(front.tenants, request)
    if admin:
        return None
    if not tenant.manage_adapters:
        raise APIError(403, "this key may not load or unload LoRA adapters (an admin's, or a tenant's with "
                       "manage_adapters)", code="permission_denied")
    return tenant


def _not_served(name: str) -> APIError:
    return APIError(404, f"the LoRA adapter '{name}' is not served", param="lora_name", code="lora_not_found")


async def load_lora_adapter(request: Request) -> Response:
    """``POST /v1/load_lora_adapter`` (see the module docstring)."""
    front: Front = request.app.state.front
    tenant = _manager(front, request)
    body = await _body(front, request)
    name, path = _name(body, "lora_name"), _name(body, "lora_path")
    base = body.get("base_model_name") or front.models.slots[0].name
    slot = front.models.find(front.adapters.base_of(base) if isinstance(base, str) else None)
    if slot is not None and tenant is not None and base not in {n for _, n in front.visible(tenant)}:
        slot = None
    if slot is None:
        raise APIError(404, f"the model '{base}' does not exist", param="base_model_name", code="model_not_found")
    if tenant is not None and not tenant.may_use_adapter(name):
        raise APIError(403, f"this key may not load an adapter named '{name}' (its tenant's adapters)",
                       param="lora_name", code="permission_denied")
    if front.models.find(name) is not None:
        raise APIError(400, f"'{name}' is the name of a served model", param="lora_name")
    future = front.models.hold(slot)
    try:
        try:
            handle = await asyncio.wrap_future(future)
        except ModelUnavailable as e:
            raise unavailable(e)
        adapter = Adapter(name, path, slot.name)
        front.metrics.lora.prime(slot.name, name)
        try:
            await on_engine(lambda: load_on_engine(front, handle, adapter, replace=True))
        except AdapterBusy as e:  # (a request would wait for a slot; an admin's load answers now)
            front.metrics.lora.loads.labels(slot.name, "busy").inc()
            raise APIError(503, str(e), code="lora_slots_busy", headers={"Retry-After": "1"})
        front.adapters.add(adapter)
    finally:
        front.models.release(slot)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """``POST /v1/unload_lora_adapter`` (see the module docstring)."""
    front: Front = request.app.state.front
    tenant = _manager(front, request)
    body = await _body(front, request)
    name = _name(body, "lora_name")
    if front.adapters.get(name) is None or (tenant is not None and not tenant.may_use_adapter(name)):
        raise _not_served(name)
    adapter = front.adapters.remove(name)
    if adapter is None:
        raise _not_served(name)
    slot = front.models.find(adapter.base)
    if slot is not None and slot.handle is not None:
        await on_engine(lambda: unload_on_engine(front, slot.handle, name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

"""Admitting a call, the same way for every protocol: authenticate, check the tenant's
limits, read the body, then find and hold the model it names.

:class:`Front` is what a request meets before its model (settings, tenants, limits,
books, the model registry); :class:`Call` is one admitted request. The model itself
reaches request code as a :class:`~gateway.models.handle.ModelHandle`, once the call
holds it (:meth:`Call.hold_model`, :meth:`Call.ready`): a model the tenant may not use
answers exactly like one that does not exist (404), so its existence is not revealed.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from starlette.requests import Request

from gateway.config import ServeConfig
from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle
from gateway.models.lora import Adapter, AdapterCatalog, lora_modules, ready_adapter
from gateway.models.registry import ModelRegistry, ModelUnavailable, Slot
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_log import RequestRecord
from gateway.tenancy.auth import authenticate
from gateway.tenancy.limits import Limiter, Ticket
from gateway.tenancy.tenants import PRIORITIES, Tenant, TenantTable
from gateway.tenancy.usage import UsageBook


@dataclass(eq=False)
class Front:
    """What every request meets before its model.

    ``tenants`` is replaced as a whole on reload (SIGHUP); calls in flight keep the
    :class:`Tenant` they started with. ``draining`` is set at SIGTERM: new generation
    requests get 503, running ones finish.
    """

    config: ServeConfig
    models: ModelRegistry
    metrics: GatewayMetrics
    tenants: TenantTable
    limiter: Limiter = field(default_factory=Limiter)
    usage: UsageBook = field(default_factory=UsageBook)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: AdapterCatalog = field(default_factory=AdapterCatalog)  # LoRA adapters (gateway.models.lora)

    def __post_init__(self) -> None:
        self.limiter.on_limited = lambda tenant, limit: self.metrics.rate_limited.labels(tenant, limit).inc()
        for name, path in lora_modules(self.config.lora_modules):  # on the first model
            self.adapters.add(Adapter(name, path, self.models.slots[0].name))
        for slot in self.models.slots:  # the models file's
            for name, path in slot.spec.lora_modules:
                self.adapters.add(Adapter(name, path, slot.name))

    def visible(self, tenant: Tenant) -> list[tuple[Slot, str]]:
        """The model names ``tenant`` may use (and so may see), with their models, in
        configuration order."""
        return [(s, n) for s in self.models.slots for n in s.spec.names if tenant.may_use(n)] + [
            (self.models.find(a.base), a.name) for a in self.adapters.all()
            if tenant.may_use(a.name) and self.models.find(a.base) is not None]

    def find_model(self, tenant: Tenant, name: Optional[str]) -> Slot:
        """The model ``name`` names (a served name or an alias; the first model the tenant
        may use when None).

        Raises:
            APIError: 404 ``model_not_found`` for a model this server does not serve, and
                for a name ``tenant`` may not use (the same answer: its existence is not revealed).
        """
        if name is None:
            visible = self.visible(tenant)
            if visible:
                return visible[0][0]
        else:
            slot = self.models.find(self.adapters.base_of(name))
            if slot is not None and tenant.may_use(name):
                return slot
        raise APIError(404, f"the model '{name}' does not exist" if name is not None else
                       "no model is available to this key", param="model", code="model_not_found")


@dataclass(eq=False)
class Call:
    """One admitted HTTP call: who made it, on which ``api`` (``chat``, ``completions``,
    ``messages``, ``responses``), its body, the record the middleware logs, and the model
    it holds (once :meth:`hold_model` found it)."""

    front: Front
    request: Request
    tenant: Tenant
    ticket: Ticket
    record: RequestRecord
    api: str
    body: object = None
    priority: str = "standard"  # the latency class (tenancy.tenants.PRIORITIES)
    slot: Optional[Slot] = None
    adapter: Optional[str] = None  # the LoRA adapter the call's model names (gateway.models.lora)

    @property
    def rank(self) -> int:
        """The latency class as the engine numbers it: 0 interactive, 1 standard, 2 batch."""
        return PRIORITIES.index(self.priority)

    def hold_model(self, name: Optional[str]) -> Future:
        """Find the model ``name`` and hold it until the call is answered; a Future of
        its handle (done unless it must be loaded first).

        Raises:
            APIError: 404 for an unknown model or one the tenant may not use.
        """
        slot = self.front.find_model(self.tenant, name)
        future = self.front.models.hold(slot)
        self.slot = slot
        self.adapter = name if self.front.adapters.get(name) is not None else None
        self.record.model = self.adapter or slot.name  # an adapter's requests are counted under its name
        self.request.state.on_close.append(lambda: self.front.models.release(slot))
        return future

    async def ready(self, future: Future) -> ModelHandle:
        """The held model, once loaded.

        Raises:
            APIError: 503 (with ``Retry-After``) when it could not be loaded.
        """
        try:
            handle = await asyncio.wrap_future(future)
        except ModelUnavailable as e:
            raise unavailable(e)
        if self.adapter is not None:
            await ready_adapter(handle, self.front.config, self.front.adapters.get(self.adapter))
        return handle

    async def model(self, name: Optional[str]) -> ModelHandle:
        """:meth:`hold_model` then :meth:`ready`."""
        return await self.ready(self.hold_model(name))

    @property
    def model_name(self) -> str:
        """The served name of the held model."""
        return self.adapter or (self.slot.name if self.slot is not None else "")


def sglang_priority(value: int) -> Optional[str]:
    """The latency class an integer ``priority`` asks for: SGLang's field (its scheduler
    runs larger values first, 0 when unset; sglang-router 0.3.2 adds ``"priority": 0`` to
    every ``/v1/responses`` body it forwards, and passes a client's integer on
    ``/v1/completions`` and ``/generate``). A positive value asks for ``interactive``, a
    negative one for ``batch``, 0 for nothing (None: the ``x-priority`` header or the
    tenant's class decides)."""
    return "interactive" if value > 0 else "batch" if value < 0 else None


def request_priority(tenant: Tenant, header: Optional[str], body) -> str:
    """The latency class of a request: ``priority`` in its JSON body, else the
    ``x-priority`` header, else its tenant's; a request may ask for a lower class than its
    tenant's, never a higher one.

    ``priority`` is a class name (``interactive``, ``standard``, ``batch``) or SGLang's
    integer (:func:`sglang_priority`); an integer is relative, so one above the tenant's
    class gets the tenant's class rather than a 403.

    Raises:
        APIError: 400 for a value that is neither a class nor an integer; 403
            ``priority_not_allowed`` for a class name above the tenant's.
    """
    asked = body.get("priority") if isinstance(body, dict) and "priority" in body else None
    if isinstance(asked, int) and not isinstance(asked, bool):
        cls = sglang_priority(asked)
        if cls is not None:
            return max(cls, tenant.priority, key=PRIORITIES.index)  # capped at the tenant's class
        asked = None
    if asked is None:
        asked = header
    if asked is None:
        return tenant.priority
    if asked not in PRIORITIES:
        raise APIError(400, f"priority must be one of {', '.join(PRIORITIES)} or an integer (SGLang's: "
                       f"> 0 interactive, 0 the key's class, < 0 batch), got {asked!r}", param="priority")
    if PRIORITIES.index(asked) < PRIORITIES.index(tenant.priority):
        raise APIError(403, f"this key's requests are {tenant.priority!r} at most; {asked!r} is above it",
                       param="priority", code="priority_not_allowed")
    return asked


def unavailable(e: ModelUnavailable) -> APIError:
    """The 503 for a model that could not be loaded."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return APIError(503, e.message, param="model", code=e.code, headers=headers)


# Calls admitted and not yet garbage, for the shutdown to find those still running.
_admitted: "weakref.WeakSet[Call]" = weakref.WeakSet()


def running_calls() -> list[Call]:
    """The calls admitted and not yet answered (their record is not yet logged): the ones
    a shutdown waits for, and cuts when it stops the engines."""
    return [c for c in list(_admitted) if not c.record.status]


def check_open(front: Front) -> None:
    """Raises:
        APIError: 503 ``shutting_down`` (with Retry-After) while the server drains."""
    if front.draining:
        raise APIError(503, "the server is shutting down: send the request again, to another server or "
                       "after the restart", code="shutting_down", headers={"Retry-After": "5"})


async def admit(front: Front, request: Request, endpoint: str, api: str) -> Call:
    """Authenticate, admit against the tenant's limits and read the JSON body
    (``call.body``); the adapter then parses it and holds the model it names.

    Raises:
        APIError: 401, 503, 429, 408, 413 or 400, in the order checked.
    """
    record = RequestRecord(endpoint=endpoint)
    record.marks["received"] = time.monotonic()
    request.state.record = record  # logged by the middleware whatever the outcome
    tenant = authenticate(front.tenants, request)
    record.tenant = tenant.name
    check_open(front)
    ticket = await front.limiter.begin(tenant)
    request.state.on_close.append(ticket.close)
    request.state.ticket = ticket
    front.usage.add(tenant.name, requests=1)
    cfg = front.config
    body = await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth)
    record.marks["admitted"] = time.monotonic()
    priority = request_priority(tenant, request.headers.get("x-priority"), body)
    record.priority = priority
    call = Call(front, request, tenant, ticket, record, api, body, priority)
    _admitted.add(call)
    return call

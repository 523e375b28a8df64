"""What a request meets before its model, the same for every protocol.

:class:`Front` is the app-wide state (settings, tenants, limits, books, the model
registry); :func:`admit` authenticates a request, checks its tenant's limits and reads
its body, and makes it a :class:`Call`. The model it names is held next
(:func:`gateway.conversation.start.hold`).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

from starlette.requests import Request

from gateway.config import ServeConfig
from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.models.lora import Adapter, AdapterCatalog, lora_modules
from gateway.models.registry import ModelRegistry
from gateway.models.slot import Slot
from gateway.telemetry.cache_explain import CacheExplainer
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
    explainer: CacheExplainer = field(init=False)  # why each prompt left the prefix cache where it did

    def __post_init__(self) -> None:
        self.explainer = CacheExplainer(self.metrics)
        self.limiter.on_limited = lambda tenant, limit: self.metrics.rate_limited.labels(tenant, limit).inc()
        for name, path in lora_modules(self.config.lora_modules):  # on the first model
            self.adapters.add(Adapter(name, path, self.models.slots[0].name))
        for slot in self.models.slots:  # the models file's
            for name, path in slot.spec.lora_modules:
                self.adapters.add(Adapter(name, path, slot.name))

    def visible(self, tenant: Tenant) -> list[tuple[Slot, str]]:
        """The model names ``tenant`` may use (and so may see), with their models, in
        configuration order: a base model's names when it may use them or they lead to its
        default adapter, then the adapters it may use."""
        default = self.default_adapter(tenant)
        return [(s, n) for s in self.models.slots for n in s.spec.names
                if tenant.may_use(n) or (default is not None and s.name == default.base)] + [
            (self.models.find(a.base), a.name) for a in self.adapters.all()
            if tenant.may_use_adapter(a.name) and self.models.find(a.base) is not None]

    def default_adapter(self, tenant: Tenant) -> Optional[Adapter]:
        """The served adapter ``tenant``'s requests for its base model run under (its
        ``default_adapter``); None when it has none or that adapter is not served now."""
        return self.adapters.get(tenant.default_adapter)


@dataclass(eq=False)
class Call:
    """One admitted HTTP call: who made it, on which ``api`` (``chat``, ``completions``,
    ``messages``, ``responses``), its body, the record the middleware logs, and the model
    it holds (once held)."""

    front: Front
    request: Request
    tenant: Tenant
    ticket: Ticket
    record: RequestRecord
    api: str
    body: object = None
    priority: str = "standard"  # the latency class (tenancy.tenants.PRIORITIES)
    rank: int = 1  # the latency class as the engine numbers it: 0 interactive, 1 standard, 2 batch
    slot: Optional[Slot] = None  # the model, once held (gateway.conversation.start.hold)
    adapter: Optional[str] = None  # the LoRA adapter the call's model names (gateway.models.lora)

    @property
    def model_name(self) -> str:
        """The name the call's answers carry: its adapter's, else its held model's."""
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
    call = Call(front, request, tenant, ticket, record, api, body, priority, PRIORITIES.index(priority))
    _admitted.add(call)
    return call

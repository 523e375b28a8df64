"""Admitting a generation call, the same way for every protocol: authenticate, check
the engine and the tenant's limits, read the body, and check the model."""

from __future__ import annotations

import weakref
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from starlette.requests import Request

from gateway.http.body import read_json
from gateway.http.errors import APIError
from gateway.telemetry.request_log import RequestRecord
from gateway.tenancy.auth import authenticate
from gateway.tenancy.limits import Ticket
from gateway.tenancy.tenants import Tenant
from scheduler import Engine

if TYPE_CHECKING:
    from gateway.http.app import ServerState


@dataclass(eq=False)
class Call:
    """One admitted HTTP call: who made it, on which ``api`` (``chat``, ``completions``,
    ``messages``, ``responses``), and the record the middleware logs."""

    tenant: Tenant
    ticket: Ticket
    record: RequestRecord
    engine: Engine
    api: str
    body: object = None


# Calls admitted and not yet garbage, for the shutdown to find those still running.
_admitted: "weakref.WeakSet[Call]" = weakref.WeakSet()


def running_calls(engine: Engine) -> list[Call]:
    """The calls admitted on ``engine`` and not yet answered (their record is not yet
    logged): the ones a shutdown waits for, and cuts when it stops the engine."""
    return [c for c in list(_admitted) if c.engine is engine and not c.record.status]


def ready_engine(state: "ServerState") -> Engine:
    """The engine, when it can take requests.

    Raises:
        APIError: 503 while the server shuts down (``shutting_down``) or the model loads
            (both with Retry-After), or after the engine stopped.
    """
    if state.draining:
        raise APIError(503, "the server is shutting down: send the request again, to another server or "
                       "after the restart", code="shutting_down", headers={"Retry-After": "5"})
    if state.engine is None:
        msg = state.load_error or "the model is still loading"
        raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
    if not state.engine.alive:
        raise APIError(503, "the model engine has stopped", code="engine_unavailable")
    return state.engine


def model_names(state: "ServerState", tenant: Tenant) -> list[str]:
    """The names of the served model that ``tenant`` may use."""
    return [n for n in (state.model_id, *state.config.served_model_names) if tenant.may_use(n)]


def check_model(state: "ServerState", tenant: Tenant, model: Optional[str]) -> None:
    """Raises:
        APIError: 404 for a model this server does not serve, 403 for one the tenant may not use."""
    names = {state.model_id, *state.config.served_model_names}
    if model is not None and model not in names:
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")
    if not tenant.may_use(model or state.model_id):
        raise APIError(403, f"this key may not use the model '{model or state.model_id}'",
                       param="model", code="model_not_allowed")


async def admit(state: "ServerState", request: Request, endpoint: str, api: str) -> Call:
    """Authenticate, admit against the tenant's limits and read the JSON body
    (``call.body``); the adapter then parses it and calls :func:`check_model`.

    Raises:
        APIError: 401, 503, 429, 408, 413 or 400, in the order checked.
    """
    record = RequestRecord(model=state.model_id, endpoint=endpoint)
    record.marks["received"] = time.monotonic()
    request.state.record = record  # logged by the middleware whatever the outcome
    tenant = authenticate(state.tenants, request)
    record.tenant = tenant.name
    engine = ready_engine(state)
    ticket = state.limiter.begin(tenant)
    request.state.ticket = ticket
    state.usage.add(tenant.name, requests=1)
    cfg = state.config
    body = await read_json(request, cfg.max_body_bytes, cfg.client_timeout, cfg.max_json_depth)
    record.marks["admitted"] = time.monotonic()
    call = Call(tenant, ticket, record, engine, api, body)
    _admitted.add(call)
    return call

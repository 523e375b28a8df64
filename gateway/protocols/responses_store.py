"""Stored responses of the Responses API, per tenant: the store the routes talk to.

An entry keeps the response object (for ``GET /v1/responses/{id}``) and the conversation up
to and including it as input items (for ``previous_response_id`` and ``input_items``): the
previous chain is flattened when the entry is stored, so continuing from it is one lookup.
An entry is kept as one JSON document, ``{"response": ..., "items": [...]}`` (compact UTF-8);
its size is the bytes of that document.

Each tenant has its own table, bounded by a number of responses and by bytes; storing past
either evicts that tenant's least recently used entries (reading an entry uses it), and an
entry unused for ``ttl`` seconds expires. Lookups are by (tenant name, id): a tenant never
sees another tenant's entries, and a foreign id looks exactly like a missing one.

:class:`ResponseStore` is what the routes await; the tables live in a backend
(``responses_store_memory.py``, ``responses_store_sqlite.py``, ``responses_store_redis.py``;
chosen by ``responses_store_open.py``). A backend that does I/O is called on a worker thread
(``anyio.to_thread``, at most :data:`THREADS` at once), never on the event loop and never on
the engine thread; encoding and decoding an entry happen on that thread too.

Failures: a store that fails or does not answer makes :meth:`ResponseStore.put` return False
(the caller answers ``store: false``, so the client learns its response was not stored) and
:meth:`ResponseStore.get` / :meth:`ResponseStore.delete` raise a 503; each is counted in
``mlx_gateway_responses_store_failures_total`` and the first of a series is logged.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol

import anyio

from gateway.http.errors import APIError
from gateway.protocols.responses_store_metrics import StoreMetrics

log = logging.getLogger("mlx_gateway.responses_store")

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 2**20
THREADS = 8  # store calls running on worker threads at once


@dataclass
class StoredResponse:
    """A stored response: ``response`` is the object as returned, ``items`` the whole
    conversation (input items and its own output items), ``size`` its JSON bytes."""

    response: dict
    items: list[dict]
    size: int


@dataclass
class Outcome:
    """What a backend operation did. ``done``: stored / found / deleted; ``count`` and
    ``nbytes``: the tenant's entries and their bytes after it; ``evicted``: entries it
    evicted (bounds); ``torn``: entries it found damaged and dropped; ``body``: the entry
    found by ``get``."""

    done: bool
    count: int
    nbytes: int
    evicted: int = 0
    torn: int = 0
    body: Optional[bytes] = None


class Backend(Protocol):
    """The tables behind a :class:`ResponseStore`. ``blocking``: whether its calls do I/O
    (they then run on worker threads, possibly several at once: the backend locks what it
    must). ``torn_at_open``: damaged entries dropped when it was opened; ``totals()``: the
    tenants' (count, bytes) known at open. Every method may raise on a store failure."""

    blocking: bool
    torn_at_open: int

    def describe(self) -> str: ...

    def totals(self) -> dict[str, tuple[int, int]]: ...

    def put(self, tenant: str, rid: str, body: bytes) -> Outcome: ...

    def get(self, tenant: str, rid: str) -> Outcome: ...

    def delete(self, tenant: str, rid: str) -> Outcome: ...

    def close(self) -> None: ...


def check_bounds(max_responses: int, max_bytes: int) -> None:
    """Raises:
        ValueError: a bound below 1."""
    if max_responses < 1 or max_bytes < 1:
        raise ValueError("the response store's bounds must be at least 1")


def encode(response: dict, items: list[dict]) -> bytes:
    """An entry as stored: compact UTF-8 JSON of ``{"response", "items"}``."""
    return json.dumps({"response": response, "items": items}, ensure_ascii=False, separators=(",", ":")).encode()


def decode(body: bytes) -> StoredResponse:
    """The entry stored as ``body``.

    Raises:
        ValueError: not an entry (damaged).
    """
    doc = json.loads(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("response"), dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a stored response")
    return StoredResponse(doc["response"], doc["items"], len(body))


def unavailable() -> APIError:
    """The 503 for a lookup or a delete the store could not answer."""
    return APIError(503, "the response store is not available right now; try again later",
                    code="store_unavailable", headers={"Retry-After": "1"})


class ResponseStore:
    """The per-tenant stored responses, over ``backend``; ``tenants()`` names the
    configured tenants (their metric series exist from the start). Its metrics are
    :attr:`metrics` (a collector to register)."""

    def __init__(self, backend: Backend, tenants: Callable[[], Iterable[str]] = tuple):
        self.backend = backend
        self.metrics = StoreMetrics(tenants)
        self.metrics.torn += backend.torn_at_open
        self.metrics.totals.update(backend.totals())
        self._threads = anyio.CapacityLimiter(THREADS) if backend.blocking else None
        self._failing = False

    async def _call(self, fn, *args):
        if self._threads is None:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def _put(self, tenant: str, response: dict, items: list[dict]) -> Outcome:
        return self.backend.put(tenant, response["id"], encode(response, items))

    def _get(self, tenant: str, rid: str) -> tuple[Outcome, Optional[StoredResponse]]:
        out = self.backend.get(tenant, rid)
        if out.body is None:
            return out, None
        try:
            return out, decode(out.body)
        except ValueError:
            log.warning("stored response %s of tenant %s is damaged: dropped", rid, tenant)
            gone = self.backend.delete(tenant, rid)
            return Outcome(False, gone.count, gone.nbytes, torn=out.torn + 1), None

    async def put(self, tenant: str, response: dict, items: list[dict]) -> bool:
        """Store ``response`` (keyed by its ``id``) with its conversation ``items``, evicting
        the tenant's least recently used entries to stay within the bounds. Returns False
        when it was not stored: the entry alone is over the byte bound, or the store failed."""
        try:
            out = await self._call(self._put, tenant, response, items)
        except Exception as e:  # a store failure of any kind: the answer goes out unstored
            self._failed("put", e)
            return False
        self._answered(tenant, out)
        return out.done

    async def get(self, tenant: str, rid: str) -> Optional[StoredResponse]:
        """The tenant's entry ``rid`` (now its most recently used), or None.

        Raises:
            APIError: 503 when the store failed.
        """
        try:
            out, entry = await self._call(self._get, tenant, rid)
        except Exception as e:
            self._failed("get", e)
            raise unavailable() from e
        self._answered(tenant, out)
        return entry

    async def delete(self, tenant: str, rid: str) -> bool:
        """Forget the tenant's entry ``rid``; False when it has none.

        Raises:
            APIError: 503 when the store failed.
        """
        try:
            out = await self._call(self.backend.delete, tenant, rid)
        except Exception as e:
            self._failed("delete", e)
            raise unavailable() from e
        self._answered(tenant, out)
        return out.done

    async def aclose(self) -> None:
        """Close the backend (a file store is checkpointed; nothing is lost either way)."""
        try:
            await self._call(self.backend.close)
        except Exception as e:
            log.warning("response store %s: close failed: %s", self.backend.describe(), e)

    def _answered(self, tenant: str, out: Outcome) -> None:
        m = self.metrics
        m.totals[tenant] = (out.count, out.nbytes)
        if out.evicted:
            m.evictions[tenant] = m.evictions.get(tenant, 0) + out.evicted
        m.torn += out.torn
        if self._failing:
            self._failing = False
            log.info("response store %s answers again", self.backend.describe())

    def _failed(self, operation: str, error: BaseException) -> None:
        self.metrics.failures[operation] = self.metrics.failures.get(operation, 0) + 1
        why = type(error).__name__ + (f": {error}" if str(error) else "")
        if not self._failing:
            self._failing = True
            log.warning("response store %s failed (%s, %s): responses are answered with store false, and "
                        "lookups with 503, until it answers", self.backend.describe(), operation, why)
        else:
            log.debug("response store %s failed again (%s, %s)", self.backend.describe(), operation, why)
